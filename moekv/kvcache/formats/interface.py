"""The interface every KV format implements: KVFormat, the per-layer storage it allocates
(LayerKVCache), which decode steps it lets the engine replay from CUDA graphs (GraphSupport,
GraphStepHooks), and its optional capabilities, each with a default that means "none".

The machinery the compressed formats share lives beside it: paged.py (page layouts, staging,
non-finite checks), fragment.py (pools in a Gluon decode kernel's fragment order, the kernel
choice), dense.py (the reference attention every format can fall back on). Imports run one way:
dense <- interface <- paged <- fragment.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from moekv.context import Context, HostLists
from moekv.kvcache.formats.dense import StepKV, is_decode_only
from moekv.kvcache.formats.names import DEFAULT_DECODE_KERNEL

PAGE_ALIGN_BYTES = 128  # pages start on 128-byte lines so kernels can issue full-line loads


@dataclass(frozen=True)
class StatisticGauge:
    """How the server exports one of a format's run_statistics keys: the gauge moekv:<metric>
    (help text `doc`), with `labels` (name, value) beside the model's name. Keys of one format may
    share a metric with different labels (tiered's tier shares: one gauge, a label per tier)."""

    metric: str
    doc: str
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ReadCounts:
    """Bits and elements attention read (KVFormat.read_counts); counts of several runs add up."""

    bits: float
    elements: int

    @property
    def bits_per_element(self) -> float | None:
        return self.bits / self.elements if self.elements else None

    def __add__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(self.bits + other.bits, self.elements + other.elements)


@dataclass(frozen=True)
class CalibrationFitter:
    """The learned tables `moekv calibrate` fits for a format (KVFormat.calibration_fitter).

    fit(pages, layer, kind, generator, **options) -> {table name: tensor}: one layer's tables for
    one kind ('key' / 'value') from that layer's sampled pages [n, Hkv, P, D] fp32 (post-RoPE K or
    V, P the calibration's block_size); names start with '<format>.layer<layer>.'; the tool calls it
    for every (layer, kind) in order and hands every fitter the same seeded generator.
    options: the keyword options fit takes, with their defaults (the tool's `<format>_<option>`
    arguments override them). summary(tables, options, seed) -> what the calibration record says
    about this format's tables (a JSON object), or None."""

    fit: Callable[..., dict[str, torch.Tensor]]
    options: dict[str, Any] = field(default_factory=dict)
    summary: Callable[[dict[str, torch.Tensor], dict[str, Any], int], dict] | None = None


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
    # the model's RoPE base (set by the model runner): what a format storing keys before RoPE
    # (keys_before_rope) rotates them by when it reads them; None where nobody set it
    rope_theta: float | None = None
    # paged formats: for each prefill chunk that starts inside a page and completes it, the page's
    # earlier rows as they were staged (16-bit) before the step, {seq_slot: {"k" | "v": (the page's
    # first position, rows [Hkv, n, D])}}; written by paged.stage_tokens (replaced at every call),
    # read by the same step's attention (dense.with_step_kv's `staged`)
    staged_before_step: dict | None = None

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

    def sliding_window_unsupported(self) -> str | None:
        """Why this format cannot serve attention layers with a sliding window, or None (the engine
        refuses such a model with it before allocating)."""
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
               sliding_window: int | None, step_kv: StepKV | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] over each sequence's cached context -> [T, Hq, D].

        sinks [Hq]: a logit per query head that joins every softmax as one more key whose value is
        0 (gpt-oss's attention sinks), or None. Every path takes it: the reference, and the decode
        kernels where their split-K partials are merged (ops/decode/common.reduce_head).

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
                                              scale, sliding_window, spec, sinks=sinks)
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv, sinks)

    def attend_reference(self, q: torch.Tensor, cache: LayerKVCache, ctx: Context, scale: float,
                         sliding_window: int | None, step_kv: StepKV | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
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

    # -- optional capabilities: each default means "this format has none" ------------------------
    def run_statistics(self, caches: list[LayerKVCache]) -> dict[str, float]:
        """Figures that depend on the run, over every layer's cache (tiered: the share of pages in
        each tier), by name: the engine's stats (EngineStats.kv_format) and the server's metrics
        (statistic_gauges) export them. None by default. May be read from another thread: a step
        stale at worst."""
        return {}

    # how the server exports run_statistics' keys: key -> StatisticGauge (a named, labelled gauge);
    # a key not listed here becomes moekv:kv_format_stat{name=<key>}
    statistic_gauges: dict[str, StatisticGauge] = {}

    def read_counts(self, decode: bool = False) -> ReadCounts | None:
        """What attention has read since reset_read_counters, for a format whose bits read depend on
        the run (tiered: which tier each page is in); decode: only the decode rows' reads, counted
        while count_decode_reads is on. None (the default): attention reads bits_per_element."""
        return None

    def reset_read_counters(self) -> None:
        """Start read_counts afresh. Nothing by default."""

    def count_decode_reads(self, on: bool = True) -> None:
        """Count what decode rows read (read_counts(decode=True)) from now on, or stop: host time in
        every step, so it is off until an evaluation asks. Nothing by default."""

    def shard_tables(self, kv_heads: range, num_kv_heads: int) -> None:
        """Tensor parallelism: cut the tables this format keeps per KV head (calibrated codebooks,
        [num_kv_heads, ...] each) to the heads `kv_heads` this rank keeps, before any pool is
        allocated; a format built of others forwards to them. Nothing by default."""

    # the tables `moekv calibrate` fits for this format (CalibrationFitter), or None: nothing to fit
    calibration_fitter: CalibrationFitter | None = None

    # the Gluon decode kernel its pools can be laid out for (fragment.GluonKernel, declared in the
    # format's file), or None: no Gluon kernel, slab pools and the Triton kernel whatever decode_kernel says
    gluon_kernel = None

    def fragment_pages(self, block_size: int, head_dim: int, device: torch.device | str | None = None) -> bool:
        """Whether pools of this shape (on `device`) keep their pages in the Gluon kernel's fragment
        order, as decode_kernel chooses (GluonKernel.wanted); False without a Gluon kernel."""
        return self.gluon_kernel is not None and self.gluon_kernel.wanted(self, block_size, head_dim, device)

    def is_fragment_pool(self, cache: LayerKVCache) -> bool:
        """Whether this pool keeps its pages in the Gluon kernel's fragment order."""
        return self.gluon_kernel is not None and self.gluon_kernel.marker in cache.tensors


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


