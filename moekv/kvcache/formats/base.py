"""The interface every KV format implements, and the machinery the compressed ones share.

A format stores each layer's K and V in page pools. Compressed formats ("paged" formats) lay a
page out as one byte slab per (page, kv_head) — codes, scales, centroids, outliers at fixed
offsets, the slab padded to whole 128-byte lines — so a GPU kernel can find every field of a
page from its id alone. A page is quantized when it is full; until then its tokens wait in a bf16
(model dtype) *staging page* owned by the sequence (one per running sequence), which attention
reads directly. Bits per element count every byte of the slab, padding included.
"""
from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moekv.context import Context, HostLists, to_device
from moekv.kvcache.formats.names import DEFAULT_DECODE_KERNEL, check_decode_kernel
from moekv.ops.reference import causal_attention_ref

# a step's k, v [T, Hkv, D] as the attention layer computed them (k after RoPE): KVFormat.attend
StepKV = tuple[torch.Tensor, torch.Tensor]

PAGE_ALIGN_BYTES = 128  # pages start on 128-byte lines so kernels can issue full-line loads
FIELD_ALIGN_BYTES = 16  # fields inside a slab start on 16-byte boundaries (vector loads)


@dataclass
class LayerKVCache:
    """One layer's storage: the tensors a format allocates, by name (e.g. k_pages, v_pages)."""

    tensors: dict[str, torch.Tensor]
    layer: int = 0  # which decoder layer (formats with per-layer calibration look theirs up)
    # [] bool on the cache's device: a graph step quantized non-finite K/V (flag_nonfinite);
    # allocated by the formats that quantize pages in graph steps, None for the others
    nonfinite: torch.Tensor | None = None
    # host-side state a format keeps per layer beside the tensors (tiered: its TieredState), or None
    state: object | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class RopeWriteTarget:
    """Where the fused RoPE + K/V store (ops/rope_kv_write.py) puts a step's rotated k and its v.

    staged=False: k_dest, v_dest are pages [N, Hkv, P, D] and index is ctx.slot_mapping [T];
    staged=True: staging pages [S, Hkv, P, D] at (index = ctx.seq_slots [B], position % P), and
    the optional rings [S, Hkv, R, D] at (seq_slots, position % R).
    """

    k_dest: torch.Tensor
    v_dest: torch.Tensor
    index: torch.Tensor
    staged: bool = False
    k_ring: torch.Tensor | None = None
    v_ring: torch.Tensor | None = None


class GraphSupport(enum.Enum):
    """Which decode steps of a format the engine may replay from a CUDA graph (engine/cuda_graphs.py).

    A replayable step writes and attends without host syncs (write's vectorized path + a fused
    decode kernel); the runner also needs fused_decode_unavailable() to be None. Host-side state
    such a step would change is kept by the GraphStepHooks a format may implement.
    """

    EAGER_ONLY = "eager_only"  # every step runs eagerly
    DECODE_WITHOUT_FILLS = "decode_without_fills"  # decode steps that fill no page; the others run eagerly
    # decode steps, page-filling ones too: the filled page takes its token through slot_mapping like any other
    DECODE_WITH_FILLS = "decode_with_fills"
    # decode steps, page-filling ones too, whose filled pages the runner lists in ctx.fill_slots /
    # fill_pages for the format to quantize (quantize_filled_pages); the graph runner then keeps one
    # graph per number of fills (rounded up to a power of two) in each batch bucket
    DECODE_WITH_LISTED_FILLS = "decode_with_listed_fills"

    @property
    def replays_decode(self) -> bool:
        return self is not GraphSupport.EAGER_ONLY

    @property
    def replays_fills(self) -> bool:
        return self in (GraphSupport.DECODE_WITH_FILLS, GraphSupport.DECODE_WITH_LISTED_FILLS)

    @property
    def lists_fills(self) -> bool:
        return self is GraphSupport.DECODE_WITH_LISTED_FILLS


class KVFormat(ABC):
    name: str
    needs_calibration: bool = False
    graph_support: GraphSupport = GraphSupport.EAGER_ONLY
    # the decode kernel its pools are laid out for (names.DECODE_KERNELS; EngineConfig.cache.decode_kernel),
    # given by the registry when it builds the format (get_kv_format) and fixed from then on: page_bytes
    # and allocate read it, so pools of one format object all take one layout
    decode_kernel: str = DEFAULT_DECODE_KERNEL
    # the options it takes from the engine's configuration (options.KVOption: EngineConfig's kv_<name>,
    # the flag --kv-<name>), each a keyword of its constructor
    engine_options: tuple = ()

    @abstractmethod
    def page_bytes(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        """Bytes one full page (K and V, one layer) occupies, every side table and padding included."""

    def bits_per_element(self, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        """Every stored bit of a full page over its (tokens x kv_heads x head_dim x {K, V}) elements."""
        return 8 * self.page_bytes(num_kv_heads, block_size, head_dim) / (2 * block_size * num_kv_heads * head_dim)

    def staging_bytes_per_seq(self, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        """Bytes per running sequence (one layer) for its partly filled newest page (and any
        full-precision window); 0 if none."""
        return 0

    def bits_per_element_at(self, context_len: int, num_kv_heads: int, block_size: int, head_dim: int) -> float:
        """Bits per element of one running sequence of context_len tokens (one layer, K and V): its
        full pages plus its staging bytes, over the elements it caches."""
        if context_len < 1:
            raise ValueError(f"context_len={context_len} must be >= 1")
        nbytes = ((context_len // block_size) * self.page_bytes(num_kv_heads, block_size, head_dim)
                  + self.staging_bytes_per_seq(num_kv_heads, block_size, head_dim))
        return 8 * nbytes / (2 * context_len * num_kv_heads * head_dim)

    def check_layout(self, num_kv_heads: int, block_size: int, head_dim: int) -> None:
        """Raise ValueError if this format cannot lay out pages of this shape."""

    def release_pages(self, cache: LayerKVCache, pages: list[int]) -> None:
        """Pages went back to the block manager's free list: drop any state kept for them."""

    def prefix_caching_unsupported(self) -> str | None:
        """Why full pages of this format cannot be shared between sequences by prefix caching, or None.
        Sharing needs a written full page to stay as written, and a sequence's attention to need
        nothing beyond its pages that only computing the prefix would have produced (the 16-bit
        staging page is rebuilt, since a sequence resumes at a page boundary)."""
        return None

    @abstractmethod
    def allocate(self, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device, max_num_seqs: int, dtype: torch.dtype) -> LayerKVCache: ...

    @abstractmethod
    def write(self, cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> None:
        """Store the step's k, v [T, Hkv, D] (token t of sequence b at position ctx.positions[t])."""

    def fused_rope_write_target(self, cache: LayerKVCache, k: torch.Tensor, ctx: Context) -> RopeWriteTarget | None:
        """Where a fused RoPE + store kernel may put this step's k (pre-RoPE, [T, Hkv, D]) and v so
        that the cache ends as `write` would leave it, or None: RoPE, then `write` (the default)."""
        return None

    def quantize_filled_pages(self, caches: list[LayerKVCache], ctx: Context) -> None:
        """After a decode step's last layer (ctx.fill_slots / fill_pages: the pages it filled): what
        the format does with them, in every layer's cache (`caches`). Nothing by default."""

    def attend(self, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
               sliding_window: int | None, step_kv: StepKV | None = None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached context -> [T, Hq, D].

        step_kv: the step's k, v [T, Hkv, D] as the layer computed them (k after RoPE), which
        `write` has just stored. A sequence with several queries in the step (a prefill chunk)
        attends to its own positions of this step through them, exact, and to its earlier
        positions as the cache holds them (`with_step_kv`); a one-token query reads its token
        from the cache, as decode does. None: every position from the cache.

        Decode-only steps on CUDA go to the fused paged decode kernel when the format describes
        its pages to it (`decode_spec`); everything else (CPU, prefill) takes `attend_reference`.
        """
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and is_decode_only(q, ctx):
            staging = cache.tensors.get("k_staging")
            pages = cache["k_pages"] if "k_pages" in cache.tensors else None
            block_size = staging.shape[2] if staging is not None else (pages.shape[2] if pages is not None else 0)
            spec = self.decode_spec(block_size, q.shape[-1]) if block_size else None
            if spec is not None:
                from moekv.ops.decode.paged import paged_decode_attention

                return paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                              scale, sliding_window, spec)
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv)

    def attend_reference(self, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
                         sliding_window: int | None, step_kv: StepKV | None = None) -> torch.Tensor:
        """The plain-PyTorch path of `attend` (CPU, prefill, and the oracle of the fused kernels)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither attend nor attend_reference")

    def decode_spec(self, block_size: int, head_dim: int):
        """How the paged decode kernel reads this format's pages (a moekv.ops.decode.common.DecodeSpec),
        or None to keep the reference path on CUDA too. Formats plug their tile readers in here."""
        return None

    def fused_decode_unavailable(self, block_size: int, head_dim: int) -> str | None:
        """Why decode-only steps at this shape take the reference path on CUDA (which reads the
        context on the host, so it cannot be captured), or None when they take a fused kernel."""
        if self.decode_spec(block_size, head_dim) is None:
            return "has no fused decode kernel at this shape (reference path)"
        return None

    def stats(self, caches: list[LayerKVCache]) -> dict[str, float]:
        """Figures that depend on the run (tiered: the share of pages in each tier), for metrics;
        none by default. May be read from another thread: a step stale at worst."""
        return {}


class GraphStepHooks(ABC):
    """Opt-in for a format that keeps host-side state a replayed decode step must not skip: a CUDA
    graph repeats only the captured device work, so the runner (engine/model_runner.py) calls these
    around every replay of a format that is an instance of this class."""

    @abstractmethod
    def prepare_graph_step(self, caches: list[LayerKVCache], host: HostLists, fill_pages: list[int],
                           first_pages: list[int]) -> bool:
        """Before every replayed decode step (host: its tables; fill_pages: the pages it fills,
        first_pages: the first page of each one's sequence): host-side work the captured step relies
        on or that an eager step would do (tiered: choosing the fills' FP8 slots, counting the step,
        re-ranking). False, with nothing changed: the step must run eagerly instead."""

    @abstractmethod
    def after_graph_replay(self, caches: list[LayerKVCache]) -> None:
        """A decode step was replayed: apply the host-side effects its eager `write` / `attend`
        would have had (every layer's cache in `caches`)."""

    def graph_step_not_replayed(self, caches: list[LayerKVCache]) -> None:
        """prepare_graph_step returned True, but the step is not replayed after all: it runs eagerly
        instead (several ranks: another rank's format turned it down; one device: the replay
        failed), or it fails. Put back what only the replay would have used; the eager step must
        then do the rest without repeating what prepare_graph_step did. Nothing by default."""

    def stats(self, caches: list[LayerKVCache]) -> dict[str, float]:
        """The format's own figures over every layer's cache (exported as metrics); none by default."""
        return {}


def per_shape(method):
    """Memoize a format's method of (kind, block_size, head_dim) -- its layout, its outlier slot
    count -- per instance: they depend on the shape and options fixed at construction, and some
    cost ~1 ms to build (nuq2 and vq fit their slots to the slab's padding by trying each count),
    which eager steps paid in every layer (tiered's re-ranking steps: ~0.15 s of host time)."""
    @functools.wraps(method)
    def memoized(self, kind: str, block_size: int, head_dim: int):
        memo = self.__dict__.setdefault(f"_per_shape_{method.__name__}", {})
        key = (kind, block_size, head_dim)
        if key not in memo:
            memo[key] = method(self, kind, block_size, head_dim)
        return memo[key]
    return memoized


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # per (page, kv_head)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class PageLayout:
    """Fields of one (page, kv_head) slab at 16-byte-aligned offsets; slab padded to 128 bytes."""

    def __init__(self, fields: list[Field]) -> None:
        self.fields = fields
        self.offsets: dict[str, int] = {}
        offset = 0
        for f in fields:
            offset = -(-offset // FIELD_ALIGN_BYTES) * FIELD_ALIGN_BYTES
            self.offsets[f.name] = offset
            offset += f.nbytes
        self.used_bytes = offset
        self.slab_bytes = -(-offset // PAGE_ALIGN_BYTES) * PAGE_ALIGN_BYTES

    def pack(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """{field: [n, Hkv, *shape]} -> uint8 slabs [n, Hkv, slab_bytes]."""
        first = values[self.fields[0].name]
        n, heads = first.shape[:2]
        slab = torch.zeros(n, heads, self.slab_bytes, dtype=torch.uint8, device=first.device)
        for f in self.fields:
            t = values[f.name].to(f.dtype).contiguous().reshape(n, heads, -1)
            off = self.offsets[f.name]
            slab[:, :, off:off + f.nbytes] = t.view(torch.uint8).reshape(n, heads, f.nbytes)
        return slab

    def unpack(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 slabs [n, Hkv, slab_bytes] -> {field: [n, Hkv, *shape]}."""
        n, heads = slab.shape[:2]
        out = {}
        for f in self.fields:
            off = self.offsets[f.name]
            raw = slab[:, :, off:off + f.nbytes].contiguous()
            out[f.name] = raw.view(f.dtype).reshape(n, heads, *f.shape)
        return out


NONFINITE_MESSAGE = ("non-finite values (NaN or Inf) in the {what} being written to the KV cache; "
                     "compressed KV formats refuse them (check the model's dtype and inputs)")


def check_finite(x: torch.Tensor, what: str) -> None:
    """Policy for NaN/Inf in K/V: refuse loudly; a silent code would poison every later token."""
    if not torch.isfinite(x).all():
        raise ValueError(NONFINITE_MESSAGE.format(what=what))


def flag_nonfinite(cache: LayerKVCache, x: torch.Tensor) -> None:
    """check_finite without a host sync (inside a CUDA graph): OR the verdict into the cache's
    device flag, whose verdict (nonfinite_verdict) travels to the host with the step's samples."""
    cache.nonfinite |= ~torch.isfinite(x).all()


def nonfinite_verdict(caches: list[LayerKVCache]) -> torch.Tensor | None:
    """Whether a graph step set any cache's `nonfinite` flag, as a [] bool still on the device (so a
    pipelined step can queue its transfer without a sync); None when no cache keeps a flag."""
    flags = [c.nonfinite for c in caches if c.nonfinite is not None]
    return torch.stack(flags).any() if flags else None


def raise_nonfinite(caches: list[LayerKVCache]) -> None:
    """A step's verdict said non-finite K/V were quantized: clear the flags for the next step, raise."""
    for c in caches:
        if c.nonfinite is not None:
            c.nonfinite.zero_()
    raise ValueError(NONFINITE_MESSAGE.format(what="keys or values"))


def staging_tensors(max_num_seqs: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """[max_num_seqs, Hkv, P, D] for K and V: the newest, partly filled page of each running sequence."""
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    shape = (max_num_seqs, num_kv_heads, block_size, head_dim)
    return {"k_staging": torch.zeros(shape, dtype=dtype, device=device),
            "v_staging": torch.zeros(shape, dtype=dtype, device=device)}


def stage_tokens(cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, ctx: Context):
    """Write the step's K/V of each sequence into its staging page; yield (b, "k" | "v", page
    indices, pages) for every page the step filled, in order (a prefill chunk can fill many):
    page indices in the block table, pages [n, Hkv, P, D] fp32 (None when n = 0), rounded
    through the staging dtype exactly as staged tokens are. Whole pages of a chunk are cut from it
    in one view, not copied through staging one by one; staging ends holding the sequence's
    newest page (full or not), which attention reads from there."""
    block_size = cache["k_staging"].shape[2]
    host = ctx.host_lists()
    starts, slots = host.query_start, host.seq_slots
    for b, end in enumerate(host.context_lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        first_pos = end - (hi - lo)
        for name, x in (("k", k[lo:hi]), ("v", v[lo:hi])):  # x [T_b, Hkv, D]
            staging = cache[f"{name}_staging"][slots[b]]  # [Hkv, P, D]
            indices, pages = [], []
            pos, offset = first_pos, first_pos % block_size
            if offset:  # the partly filled page first: complete it in staging
                take = min(block_size - offset, end - pos)
                staging[:, offset:offset + take] = x[:take].transpose(0, 1).to(staging.dtype)
                pos += take
                if offset + take == block_size:
                    indices.append(pos // block_size - 1)
                    pages.append(staging.float()[None])
            num_whole = (end - pos) // block_size
            if num_whole:
                chunk = x[pos - first_pos:pos - first_pos + num_whole * block_size]
                whole = chunk.reshape(num_whole, block_size, *chunk.shape[1:]).transpose(1, 2).to(staging.dtype)
                indices += range(pos // block_size, pos // block_size + num_whole)
                pages.append(whole.float())
                pos += num_whole * block_size
                if pos == end:  # the newest page is full: staging holds it too
                    staging.copy_(whole[-1])
            if pos < end:  # the new partly filled page
                staging[:, :end - pos] = x[pos - first_pos:].transpose(0, 1).to(staging.dtype)
            yield b, name, indices, torch.cat(pages) if len(pages) > 1 else (pages[0] if pages else None)


def stage_decode_tokens(cache: LayerKVCache, k: torch.Tensor, v: torch.Tensor, ctx: Context) -> None:
    """Decode steps that fill no page: each sequence's one new token goes to its staging slot at
    offset position % P, in one indexed copy per K and V (no host sync)."""
    block_size = cache["k_staging"].shape[2]
    offsets = ctx.positions % block_size  # [B]
    for name, x in (("k", k), ("v", v)):  # x [B, Hkv, D]
        staging = cache[f"{name}_staging"]  # [S, Hkv, P, D]
        staging[ctx.seq_slots, :, offsets] = x.to(staging.dtype)


def can_stage_vectorized(q_or_k: torch.Tensor, ctx: Context) -> bool:
    """A decode step that fills no page: staging is one indexed copy."""
    return ctx.fills_no_page and ctx.max_query_len == 1 and q_or_k.shape[0] == ctx.num_seqs


def can_stage_with_fills(q_or_k: torch.Tensor, ctx: Context) -> bool:
    """A decode step that fills no page, or whose filled pages the context lists (fill_slots /
    fill_pages): staging is one indexed copy, then the listed pages are quantized in one batch."""
    return ((ctx.fills_no_page or ctx.fill_slots is not None)
            and ctx.max_query_len == 1 and q_or_k.shape[0] == ctx.num_seqs)


class PagedQuantFormat(KVFormat):
    """A compressed format that quantizes whole pages: subclasses give the layouts and the
    page-level quantize/dequantize; this class handles staging, packing and reading back."""

    # decode steps stage with one indexed copy (stage_decode_tokens) and quantize the pages they
    # fill in one batch after the last layer (quantize_filled_pages)
    graph_support = GraphSupport.DECODE_WITH_LISTED_FILLS
    # quantize() does not read per-layer tables, so pages of all layers can go in one batch
    layer_independent_quantize = True

    def layout(self, kind: str, block_size: int, head_dim: int) -> PageLayout:
        """The slab layout for kind 'key' or 'value'."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, kind: str, layer: int | None = None) -> dict[str, torch.Tensor]:
        """x [n, Hkv, P, D] (full pages, fp32) -> fields {name: [n, Hkv, *shape]}."""
        raise NotImplementedError

    def dequantize(self, fields: dict[str, torch.Tensor], kind: str, layer: int | None = None) -> torch.Tensor:
        """fields -> x_hat [n, Hkv, P, D] fp32."""
        raise NotImplementedError

    def quantize_packed(self, x: torch.Tensor, kind: str, layer: int | None = None) -> torch.Tensor:
        """Full pages x [n, Hkv, P, D] (any float dtype) -> their slabs [n, Hkv, slab_bytes] uint8:
        `quantize`, then `PageLayout.pack`. A format with a fused quantize kernel overrides it."""
        return self.layout(kind, x.shape[2], x.shape[3]).pack(self.quantize(x.float(), kind, layer))

    # -- accounting ----------------------------------------------------------------------------
    def page_bytes(self, num_kv_heads, block_size, head_dim) -> int:
        return num_kv_heads * (self.layout("key", block_size, head_dim).slab_bytes
                               + self.layout("value", block_size, head_dim).slab_bytes)

    def staging_bytes_per_seq(self, num_kv_heads, block_size, head_dim) -> int:
        return 2 * num_kv_heads * block_size * head_dim * 2  # K and V of one page in 16-bit

    def check_layout(self, num_kv_heads, block_size, head_dim) -> None:
        self.layout("key", block_size, head_dim)  # subclasses raise for shapes they cannot hold
        self.layout("value", block_size, head_dim)

    # -- pools -----------------------------------------------------------------------------------
    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        k_slab = self.layout("key", block_size, head_dim).slab_bytes
        v_slab = self.layout("value", block_size, head_dim).slab_bytes
        return LayerKVCache({
            "k_pages": torch.zeros(num_blocks, num_kv_heads, k_slab, dtype=torch.uint8, device=device),
            "v_pages": torch.zeros(num_blocks, num_kv_heads, v_slab, dtype=torch.uint8, device=device),
            **staging_tensors(max_num_seqs, num_kv_heads, block_size, head_dim, dtype, device),
        }, nonfinite=torch.zeros((), dtype=torch.bool, device=device))

    def write(self, cache, k, v, ctx) -> None:
        if can_stage_with_fills(k, ctx):  # filled pages wait for quantize_filled_pages
            stage_decode_tokens(cache, k, v, ctx)
            return
        filled: dict[str, tuple[list, list, list]] = {"k": ([], [], []), "v": ([], [], [])}  # rows, cols, pages
        for b, name, indices, pages in stage_tokens(cache, k, v, ctx):
            if indices:
                rows, cols, xs = filled[name]
                rows += [b] * len(indices)
                cols += indices
                xs.append(pages)
        for name, kind in (("k", "key"), ("v", "value")):
            rows, cols, xs = filled[name]
            if not rows:
                continue
            # every sequence's filled pages in one quantization
            x_full = torch.cat(xs)  # [n, Hkv, P, D]
            check_finite(x_full, kind + "s")
            tables = ctx.host_lists().block_tables
            page_ids = to_device([tables[b][c] for b, c in zip(rows, cols)], torch.long, x_full.device)
            self.store_slabs(cache, name, page_ids, self.quantize_packed(x_full, kind, cache.layer))

    def store_slabs(self, cache: LayerKVCache, name: str, page_ids: torch.Tensor, slabs: torch.Tensor) -> None:
        """Put freshly quantized slabs [n, Hkv, slab] of `name` ('k' / 'v') at pages page_ids. A format
        that keeps its pages in another layout (nuq2 in fragment order) converts them here."""
        cache[f"{name}_pages"][page_ids] = slabs

    def dequantize_pages(self, cache: LayerKVCache, kind: str, page_ids: torch.Tensor) -> torch.Tensor:
        """Pages page_ids of K or V dequantized: [n, Hkv, P, D] fp32 (the inverse of store_slabs)."""
        name = "k" if kind == "key" else "v"
        staging = cache[f"{name}_staging"]
        fields = self.layout(kind, staging.shape[2], staging.shape[3]).unpack(cache[f"{name}_pages"][page_ids])
        return self.dequantize(fields, kind, cache.layer)

    def fused_rope_write_target(self, cache, k, ctx):
        # only the vectorized staging path; a subclass whose write does more says so itself
        if type(self).write is not PagedQuantFormat.write or not can_stage_with_fills(k, ctx):
            return None
        return RopeWriteTarget(cache["k_staging"], cache["v_staging"], ctx.seq_slots, staged=True)

    def quantize_filled_pages(self, caches, ctx) -> None:
        """After a decode step's last layer: quantize the staging pages the step filled (ctx.fill_slots)
        into their pages (ctx.fill_pages), in every layer at once (one batch of pages for all layers
        instead of a quantization in each: ~60 small kernels each for nuq2), without a host sync, so
        the step stays capturable. Until then attention read those pages from staging, as the
        newest page of a sequence always is. Non-finite K/V raise here in an eager step; in a graph
        step they set the first cache's `nonfinite` flag (read after the replay: PendingStep.wait)."""
        if ctx.fill_slots is None or ctx.fill_slots.numel() == 0:
            return
        F = ctx.fill_slots.numel()
        for name, kind in (("k", "key"), ("v", "value")):
            x = torch.cat([c[f"{name}_staging"][ctx.fill_slots] for c in caches])  # [L*F, Hkv, P, D]
            if ctx.graph_step:
                flag_nonfinite(caches[0], x)
            else:
                check_finite(x, kind + "s")
            if self.layer_independent_quantize:
                slabs = self.quantize_packed(x, kind).split(F)
            else:  # per-layer tables (calibrated codebooks): one quantization per layer
                slabs = [self.quantize_packed(x[i * F:(i + 1) * F], kind, c.layer) for i, c in enumerate(caches)]
            for c, slab in zip(caches, slabs):
                self.store_slabs(c, name, ctx.fill_pages, slab)

    def gather(self, cache, ctx: Context, b: int, length: int, kind: str) -> torch.Tensor:
        """Sequence b's first `length` (1 <= length <= context_lens[b]) tokens of K or V, dequantized
        (its newest page, in staging, as it is): [length, Hkv, D] fp32."""
        name = "k" if kind == "key" else "v"
        staging = cache[f"{name}_staging"]
        block_size, head_dim = staging.shape[2], staging.shape[3]
        # the sequence's newest page is read from staging even when full (a decode step quantizes
        # the pages it fills after every layer has attended: quantize_filled_pages); the pages
        # before it are full and quantized
        host = ctx.host_lists()
        newest = (host.context_lens[b] - 1) // block_size
        num_pages = min(-(-length // block_size), newest)
        parts = []
        if num_pages:
            page_ids = ctx.block_tables[b, :num_pages].long()
            x = self.dequantize_pages(cache, kind, page_ids)  # [n, Hkv, P, D]
            parts.append(x.permute(0, 2, 1, 3).reshape(num_pages * block_size, -1, head_dim)[:length])
        tail = length - num_pages * block_size
        if tail > 0:
            parts.append(staging[host.seq_slots[b], :, :tail].transpose(0, 1).float())
        return torch.cat(parts)

    def attend_reference(self, q, cache, ctx, scale, sliding_window, step_kv=None):
        return dense_attention(q, ctx, with_step_kv(lambda b, n: (self.gather(cache, ctx, b, n, "key"),
                                                                  self.gather(cache, ctx, b, n, "value")),
                                                    ctx, step_kv),
                               scale, sliding_window)


class FragmentPagedFormat(PagedQuantFormat):
    """A paged format whose pools can keep their pages in a Gluon decode kernel's fragment order
    (moekv/ops/gluon/<format>_layout.py) instead of slabs, for the shapes `fragment_pages` names
    (gluon_pages_wanted): such pools hold the layout's tables, pages are converted when written
    (store_slabs), read back by dequantize_pages, and decode-only steps on CUDA take the Gluon kernel
    (gluon_decode), every other step the reference path. Subclasses give the layout module, the
    kernel call and `fragment_marker`, a tensor only their fragment-order pools hold."""

    fragment_marker = "k_codes"

    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape keep their pages in fragment order."""
        raise NotImplementedError

    def fragment_layout(self):
        """The layout module: fragment_bytes_per_page_head, allocate_fragment_tables, kind_to_fragment,
        dequantize_fragment, fragment_view."""
        raise NotImplementedError

    def fragment_view(self, cache: LayerKVCache, page_ids: torch.Tensor | None = None):
        """The pool's fragment tables (pages page_ids, or all) as the layout's page object."""
        return self.fragment_layout().fragment_view(cache, page_ids)

    def to_fragment(self, cache: LayerKVCache, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Freshly quantized slabs of `kind` as the fragment tables' rows."""
        return self.fragment_layout().kind_to_fragment(self, kind, slabs)

    def gluon_decode(self, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
                     sliding_window: int | None, staged: tuple) -> torch.Tensor:
        """The Gluon kernel's decode attention over the pool, staged = (k_staging, v_staging, seq_slots)."""
        raise NotImplementedError

    def is_fragment_pool(self, cache: LayerKVCache) -> bool:
        return self.fragment_marker in cache.tensors

    def page_bytes(self, num_kv_heads, block_size, head_dim) -> int:
        if self.fragment_pages(block_size, head_dim):
            return num_kv_heads * self.fragment_layout().fragment_bytes_per_page_head(self)
        return super().page_bytes(num_kv_heads, block_size, head_dim)

    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        fragment = self.fragment_pages(block_size, head_dim, device)
        cache = super().allocate(0 if fragment else num_blocks, num_kv_heads, block_size, head_dim, device,
                                 max_num_seqs, dtype)
        if fragment:  # the fragment-order tables instead of the slab pools
            del cache.tensors["k_pages"], cache.tensors["v_pages"]
            cache.tensors.update(self.fragment_layout().allocate_fragment_tables(self, num_blocks, num_kv_heads,
                                                                                 device))
        return cache

    def store_slabs(self, cache, name, page_ids, slabs) -> None:
        if not self.is_fragment_pool(cache):
            return super().store_slabs(cache, name, page_ids, slabs)
        for field, t in self.to_fragment(cache, "key" if name == "k" else "value", slabs).items():
            cache[field][page_ids] = t

    def dequantize_pages(self, cache, kind, page_ids):
        if not self.is_fragment_pool(cache):
            return super().dequantize_pages(cache, kind, page_ids)
        return self.fragment_layout().dequantize_fragment(self.fragment_view(cache, page_ids), kind)

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None):
        """Pages in fragment order: decode-only steps on CUDA take the Gluon kernel (the staged newest
        page, and a format's own 16-bit tail, as its extra split), everything else the reference path;
        slabs: the base class's."""
        if not self.is_fragment_pool(cache):
            return super().attend(q, cache, ctx, scale, sliding_window, step_kv)
        G = q.shape[1] // cache["k_staging"].shape[1]
        if (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and G in (1, 2, 4, 8)
                and is_decode_only(q, ctx)):
            return self.gluon_decode(q, cache, ctx, scale, sliding_window,
                                     (cache["k_staging"], cache["v_staging"], ctx.seq_slots))
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv)


def gluon_pages_wanted(choice: str, covered: bool, device: torch.device | str | None, what: str,
                       by_default: bool = True) -> bool:
    """Whether a format's pools of a shape keep their pages in a Gluon decode kernel's fragment order
    (moekv/ops/gluon/), by the format's decode_kernel `choice`: 'triton' (slabs, the Triton kernel),
    'gluon' (fragment order wherever the shape is `covered`, CPU included: there the reference path
    reads it; a ValueError naming `what` the kernel covers otherwise), 'auto' (fragment order on sm_90
    CUDA devices with Gluon for covered shapes of a format whose Gluon kernel is its default,
    `by_default`; slabs elsewhere; the default)."""
    check_decode_kernel(choice)
    if choice == "triton":
        return False
    if choice == "gluon":
        if not covered:
            raise ValueError(f"decode_kernel='gluon': {what}")
        return True
    if not (covered and by_default) or not torch.cuda.is_available():
        return False
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    import importlib.util

    return importlib.util.find_spec("triton.experimental.gluon") is not None


def is_decode_only(q: torch.Tensor, ctx: Context) -> bool:
    """One query token per sequence (every query_lens == 1)."""
    if q.shape[0] != ctx.num_seqs:
        return False
    if ctx.max_query_len is not None:
        return ctx.max_query_len == 1
    return bool((ctx.query_start_loc[1:] - ctx.query_start_loc[:-1] == 1).all())


def with_step_kv(gather, ctx: Context, step_kv: StepKV | None):
    """`gather(b, length) -> (k, v) [length, Hkv, D]` over the cache, with each prefill chunk's own
    positions taken from the step's k, v as computed (step_kv, [T, Hkv, D]: see KVFormat.attend).

    A sequence with Tq > 1 queries reads its first length - Tq positions from the cache as stored
    (earlier chunks: dequantized pages, the staged page, a format's 16-bit window) and its last Tq,
    which this step computed, exactly: a compressed cache quantizes a chunk's pages when it writes
    them, and attending to those quantized copies would let a prompt's tokens see low-bit versions
    of their neighbours, an error that compounds through the layers into the K/V later layers
    store. A one-token query (decode) reads its token from the cache, as the fused decode kernels
    do. With step_kv None: `gather` itself."""
    if step_kv is None:
        return gather
    k_step, v_step = step_kv
    starts = ctx.host_lists().query_start

    def read(b: int, length: int):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo < 2:
            return gather(b, length)
        first = length - (hi - lo)  # the sequence's tokens cached before this step
        k_new, v_new = k_step[lo:hi], v_step[lo:hi]
        if first == 0:
            return k_new, v_new
        k_old, v_old = gather(b, first)
        return torch.cat([k_old, k_new.to(k_old.dtype)]), torch.cat([v_old, v_new.to(v_old.dtype)])

    return read


def dense_attention(q: torch.Tensor, ctx: Context, gather, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Attention over K/V that `gather(b, length) -> (k, v) [length, Hkv, D]` reconstructs per
    sequence: each sequence's queries through causal_attention_ref, the masking and GQA of the
    uncompressed path, with no host sync of its own (the step's tables come from ctx.host_lists)."""
    out = torch.empty_like(q)
    host = ctx.host_lists()
    starts = host.query_start
    for b, length in enumerate(host.context_lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k, v = gather(b, length)
        out[lo:hi] = causal_attention_ref(q[lo:hi], k, v, scale, sliding_window)
    return out
