"""The machinery the compressed ("paged") formats share.

A paged format lays a page out as one byte slab per (page, kv_head) -- codes, scales, centroids,
outliers at fixed offsets, the slab padded to whole 128-byte lines -- so a GPU kernel can find every
field of a page from its id alone. A page is quantized when it is full; until then its tokens wait in
a bf16 (model dtype) *staging page* owned by the sequence (one per running sequence), which attention
reads directly. Bits per element count every byte of the slab, padding included.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekv.context import Context, to_device
from moekv.kvcache.formats.dense import dense_attention, with_step_kv
from moekv.kvcache.formats.interface import (
    PAGE_ALIGN_BYTES,
    GraphSupport,
    KVFormat,
    LayerKVCache,
    RopeWriteTarget,
)
from moekv.ops.reference import rope_rotate_ref

FIELD_ALIGN_BYTES = 16  # fields inside a slab start on 16-byte boundaries (vector loads)


def per_shape(method):
    """Memoize a format's method of (kind, block_size, head_dim) -- its layout, its outlier slot
    count -- per instance: they depend on the shape and options fixed at construction, and some are
    costly to build (nuq2 and vq fit their slots to the slab's padding by trying each count), which
    eager steps would pay in every layer (docs/decisions.md: the formats' host work in bulk)."""
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
    cache.staged_before_step = {}
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
                if offset + take == block_size and hi - lo > 1:  # a chunk completes it: keep its staged rows
                    cache.staged_before_step.setdefault(slots[b], {})[name] = (
                        pos - offset, staging[:, :offset].clone())
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


def rope_theta_of(cache: LayerKVCache) -> float:
    """The RoPE base a keys_before_rope format rotates the cache's keys by (LayerKVCache.rope_theta)."""
    if cache.rope_theta is None:
        raise ValueError("keys_before_rope: the layer's KV cache has no rope_theta (the model runner sets it "
                         "from the model's config; set LayerKVCache.rope_theta where pools are built by hand)")
    return cache.rope_theta


def rotate_key_pages(x: torch.Tensor, page_starts: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """Key pages x [n, Hkv, P, D] whose row t sits at position page_starts[n] + t, rotated by RoPE
    (or rotated back, inverse: the keys as the layer computed them before RoPE), in x's dtype."""
    n, H, P, D = x.shape
    positions = (page_starts.to(torch.long)[:, None] + torch.arange(P, device=x.device)).reshape(-1)
    rows = x.permute(0, 2, 1, 3).reshape(n * P, H, D)
    return rope_rotate_ref(rows, positions, theta, inverse).reshape(n, P, H, D).permute(0, 2, 1, 3)


def fill_page_starts(ctx: Context, block_size: int) -> torch.Tensor:
    """The first position of each page a decode step filled (ctx.fill_slots [F]): the page of the
    token of the row whose staging slot it is, without a host sync. A padded fill (the scratch slot,
    no row) gets some row's: its page is the scratch page, never read."""
    rows = (ctx.seq_slots[None, :] == ctx.fill_slots[:, None]).to(torch.int32).argmax(dim=1)  # [F]
    return ctx.positions[rows] // block_size * block_size


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
    # pages hold keys as computed before RoPE (staging keeps them rotated, as the layer writes them):
    # rotated back by their positions when a page is quantized, rotated again whenever one is read
    keys_before_rope = False

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
        block_size = cache["k_staging"].shape[2]
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
            if name == "k" and self.keys_before_rope:  # cols: each page's index in its sequence
                starts = torch.tensor(cols, dtype=torch.long, device=x_full.device) * block_size
                x_full = rotate_key_pages(x_full, starts, rope_theta_of(cache), inverse=True)
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
            if name == "k" and self.keys_before_rope:
                starts = fill_page_starts(ctx, x.shape[2]).repeat(len(caches))
                x = rotate_key_pages(x.float(), starts, rope_theta_of(caches[0]), inverse=True)
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
            if kind == "key" and self.keys_before_rope:  # pages 0..num_pages-1 of the sequence
                starts = torch.arange(num_pages, device=x.device) * block_size
                x = rotate_key_pages(x, starts, rope_theta_of(cache))
            parts.append(x.permute(0, 2, 1, 3).reshape(num_pages * block_size, -1, head_dim)[:length])
        tail = length - num_pages * block_size
        if tail > 0:
            parts.append(staging[host.seq_slots[b], :, :tail].transpose(0, 1).float())
        return torch.cat(parts)

    def attend_reference(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        return dense_attention(q, ctx, with_step_kv(lambda b, n: (self.gather(cache, ctx, b, n, "key"),
                                                                  self.gather(cache, ctx, b, n, "value")),
                                                    ctx, step_kv, cache.staged_before_step),
                               scale, sliding_window, sinks)

