"""tiered: pages with the most attention mass stay in FP8, the rest drop to nuq2.

Each layer keeps two physical pools, an FP8 pool (fp8_e4m3 slabs) and a low pool (nuq2 slabs),
and maps every logical page (the block manager's page id) to a slot in one of them (TieredState,
the cache's `state`). A page that fills is quantized to FP8. Attention adds each page's share of
the attention mass to a per-page score (the fused decode kernel emits it; prefill computes it
beside SDPA: key_mass). Every `rerank_interval` steps the layer ranks each sequence's full pages:
the top `tier1_fraction`, the first page (attention sinks) and the newest full page stay in FP8;
the rest are re-encoded into nuq2 and their FP8 slots return to the FP8 pool's free list. Demotion
only: a page in nuq2 has already lost the precision FP8 would keep, so promoting it back would
cost bytes and buy nothing. Which pages go where is decided by tiered_policy.py (plain Python on
plain lists); this file keeps the state, moves the slabs and mirrors the tiers to the device.

The FP8 pool holds `fp8_pool_fraction` of the pages (headroom above tier1_fraction for pages
written between re-rankings); when it runs out, the coldest unprotected FP8 page is demoted at
once. Bits per element: page_bytes() (what sizes the pool) counts a nuq2 slab per page plus the FP8
pool's share; `bits_read` tracks what attention actually read, for reports.

CUDA graphs: a decode step is device work only (staging with one indexed copy, the fused kernel,
its mass added to a device accumulator), so the engine replays every one. Its host-side work runs
in prepare_graph_step, before the replay: a step that fills pages needs FP8 slots, which only the
host's free list can give, so they are chosen there (demoting, eagerly, what must make room) and
put in a device buffer that the captured `write` reads; then the step is counted and, every
`rerank_interval` steps, the layers re-rank, as the eager `write` would (its re-ranking uses the
masses of the steps before, not this one's: the same in both). In a graph step (ctx.graph_step)
`write` does neither; after each replay the runner calls after_graph_replay, which flags the
accumulator, as the eager `attend_kernel` would have. With several ranks each rank does this on its
own pools (its KV heads' masses and tiers); if one rank's prepare_graph_step says False, every rank
runs the step eagerly, and a rank that had prepared it calls graph_step_not_replayed first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekv.context import Context, HostLists, filling_rows, to_device
from moekv.kvcache.formats.dense import dense_attention, is_decode_only, with_step_kv
from moekv.kvcache.formats.fp8 import FP8Format
from moekv.kvcache.formats.fragment import GluonKernel, attend_in_group_parts
from moekv.kvcache.formats.interface import (
    GraphStepHooks,
    GraphSupport,
    LayerKVCache,
    ReadCounts,
    RopeWriteTarget,
    StatisticGauge,
)
from moekv.kvcache.formats.nuq2 import NUQ2Format
from moekv.kvcache.formats.options import KEYS_BEFORE_ROPE, KVOption, fraction, integer_at_least
from moekv.kvcache.formats.paged import (
    PagedQuantFormat,
    can_stage_vectorized,
    check_finite,
    flag_nonfinite,
    stage_decode_tokens,
    stage_tokens,
    staging_tensors,
)
from moekv.kvcache.formats.tiered_policy import (
    TIER_FP8,
    TIER_LOW,
    TIER_NONE,
    choose_tiers,
    decayed_weight,
    is_rerank_step,
    rerank_demotions,
    tier_shares,
)

_TIER_DOC = "tiered format: share of encoded (full) pages in each tier, mean over layers."


@dataclass
class TieredState:
    """One layer's page state (LayerKVCache.state). The plain-Python fields are the source of truth
    (writes, demotions, re-ranking: tiered_policy decides on them). The fused decode kernel
    (moekv/ops/decode/tiered.py) reads device mirrors of the tier map, kept in sync wherever a page
    changes tier (_sync_pages), and adds its attention mass to a device accumulator that is folded
    into `mass` before the host reads it (_fold_mass)."""

    tier: list[int]  # per page: TIER_NONE, TIER_FP8 or TIER_LOW
    fp8_slot: list[int]  # per page: its slot in the FP8 pool, -1 outside it
    # each page's attention mass, in units of mass_weight: re-ranking halves every mass by doubling
    # the weight of what is added after it (the ranking only compares masses)
    mass: list[float]
    free_fp8: list[int]  # free FP8 slots, the next one taken from the end
    tier_dev: torch.Tensor  # [pages] int32: the device mirror of tier
    slot_dev: torch.Tensor  # [pages] int32: the device mirror of fp8_slot
    mass_dev: torch.Tensor  # [pages] fp32: mass the fused kernel added, not yet in `mass`
    # a replayed step's fills: the FP8 slot of each (prepare_graph_step), the scratch slot beyond
    # them and between steps (a capture's warm-up writes its padded fills there)
    fill_fp8_dev: torch.Tensor  # [max_num_seqs] int64
    scratch_fp8: int  # the FP8 pool's scratch slot, never handed out
    mass_weight: float = 1.0
    steps: int = 0  # steps this layer has counted (re-ranking every rerank_interval)
    # prepare_graph_step counted (and maybe re-ranked) the coming step: set until its replay is
    # done; an eager step that finds it set (the replay failed) counts nothing
    counted_ahead: bool = False
    mass_pending: bool = False  # mass_dev holds mass not yet in `mass`
    fill_slots_loaded: bool = False  # fill_fp8_dev holds real slots until the replay is done

    @classmethod
    def empty(cls, num_blocks: int, num_fp8: int, max_num_seqs: int, device: torch.device) -> TieredState:
        """Every page free, FP8 slots 0..num_fp8-1 free (slot num_fp8 is the scratch slot)."""
        return cls(tier=[TIER_NONE] * num_blocks, fp8_slot=[-1] * num_blocks, mass=[0.0] * num_blocks,
                   free_fp8=list(range(num_fp8 - 1, -1, -1)),
                   tier_dev=torch.zeros(num_blocks, dtype=torch.int32, device=device),
                   slot_dev=torch.full((num_blocks,), -1, dtype=torch.int32, device=device),
                   mass_dev=torch.zeros(num_blocks, dtype=torch.float32, device=device),
                   fill_fp8_dev=torch.full((max_num_seqs,), num_fp8, dtype=torch.long, device=device),
                   scratch_fp8=num_fp8)


def _gluon_covers(fmt: TieredFormat, block_size: int, head_dim: int) -> str | None:
    if (block_size, head_dim) == (64, 128) and not fmt.lo.calibrated:  # calibrated: slabs and the reference path
        return None
    return ("tiered's Gluon kernel covers block_size 64, head_dim 128 and page codebooks (kv_codebook='page'), "
            f"got block_size {block_size}, head_dim {head_dim}{', calibrated codebooks' if fmt.lo.calibrated else ''}")


class TieredFormat(PagedQuantFormat, GraphStepHooks):
    name = "tiered"
    # the Gluon tiered kernel (moekv/ops/gluon/tiered_decode.py): both tiers and the staged tail in one
    # launch, over pools whose low tier is in nuq2's fragment tables (see "the Gluon decode kernel's
    # pools" below); 'auto' takes it on sm_90 for the covered shape
    gluon_kernel = GluonKernel("moekv.ops.gluon.nuq2_layout", "moekv.ops.gluon.tiered_decode:tiered_decode_attention",
                               _gluon_covers, marker="k_slot_delta")
    # decode steps are device-only; the host-side step count, re-ranking and mass flag are kept by
    # the GraphStepHooks. A page that fills takes an FP8 slot from a host-side free list (and may
    # demote another page): in a replayed step the slots are chosen before it (prepare_graph_step)
    # and read from a device buffer by the captured write, which stores the listed fills itself
    graph_support = GraphSupport.DECODE_WITH_LISTED_FILLS
    # its low tier's options are nuq2's
    default_outlier_sigma = 3.0
    # its nuq2 tier fills every outlier slot (nuq2 alone fills at most 16): at 16, domain-moe's code domain
    # went from +0.8% to +1.5% through the Gluon kernel, past tiered's +1% (docs/decisions.md, "tiered's nuq2
    # tier fills every outlier slot")
    default_outlier_cap = 1024
    engine_options = (
        KVOption("rerank_interval", 32, "tiered: decode steps between re-rankings", integer_at_least(1)),
        KVOption("tier1_fraction", 0.10, "tiered: share of pages kept in FP8", fraction),
        # its low tier has no window or sinks (its first page stays FP8) and keeps post-RoPE keys
        *(o for o in NUQ2Format.engine_options
          if o.name not in ("residual", "sink_tokens") and o is not KEYS_BEFORE_ROPE),
        KVOption("rank_window", 64, "tiered: only the last N queries of each prompt chunk add to the page ranking's "
                 "attention mass (0: all)", integer_at_least(0)),
        KVOption("rank_after_prompt", True,
                 "tiered: rank (and demote) a sequence's pages only once it decodes, by its whole prompt's mass"),
    )

    def __init__(self, rerank_interval: int = 32, tier1_fraction: float = 0.10, outlier_sigma: float | None = None,
                 calibration=None, codebook: str = "auto", fp8_pool_fraction: float | None = None,
                 fused_decode: bool = True, rank_window: int = 64, rank_after_prompt: bool = True,
                 outlier_cap: int | None = None) -> None:
        # The fused two-tier decode kernel (checked against the reference on the H200,
        # benchmarks/results/h200/gpu_tests.log); fused_decode=False keeps the reference path.
        self.fused_decode = fused_decode
        # rank_window > 0: of a prompt chunk's queries only the last rank_window add attention mass
        # (an observation window, as SnapKV ranks a prompt's keys: the end of the prompt, which holds
        # the question, says what the answer will read; every query of the chunk weighs the filler's
        # local attention). 0: every query of the chunk. Decode rows always add theirs.
        # rank_after_prompt: a re-ranking demotes only the pages of sequences that decode in that
        # step; a sequence in the middle of its prompt keeps its pages until its first decode step,
        # when the whole prompt's mass (its end included) ranks them. Demotion is final, so ranking a
        # prompt before its end is read can demote the pages its end will ask for (issue 23's
        # passkeys on domain-moe). False: every sequence of the step, prompt chunks included.
        if isinstance(rank_window, bool) or not isinstance(rank_window, int) or rank_window < 0:
            raise ValueError(f"rank_window={rank_window!r} must be an integer >= 0 (0: every query)")
        self.rank_window = rank_window
        self.rank_after_prompt = rank_after_prompt
        self.hi = FP8Format()
        # its nuq2 tier's outliers beyond 3.0 standard deviations (not 3.5): at 10% FP8 pages they took
        # domain-moe's worst domain from +1.6% to +0.8% for no bits read, the slots being page padding
        # (docs/decisions.md, "tiered at 10% FP8 pages")
        self.lo = NUQ2Format(outlier_sigma=self.default_outlier_sigma if outlier_sigma is None else outlier_sigma,
                             calibration=calibration, codebook=codebook, residual=0,
                             outlier_cap=self.default_outlier_cap if outlier_cap is None else outlier_cap)
        self.rerank_interval = rerank_interval
        self.tier1_fraction = tier1_fraction
        self.fp8_pool_fraction = fp8_pool_fraction if fp8_pool_fraction is not None else min(1.0, tier1_fraction + 0.1)
        # attention's view of what it read: bits and elements (for reports). The reference path
        # counts every read it makes (prefill chunks included); the fused kernel counts nothing
        self.bits_read = 0.0
        self.elements_read = 0
        # while counting_decode_reads (count_decode_reads: evaluations turn it on): what decode rows
        # (one query) read, counted on the host from the tier map when each step is counted (after its
        # re-rank, before it attends), the same on every path, fused kernel included: the figure a
        # bandwidth-bound decode step pays. decode_pages / decode_fp8_pages: the full pages those rows
        # read, and how many of them were in FP8. Off by default: a pass over every row's pages in
        # every layer and step, host time a replayed step would wait for (docs/decisions.md)
        self.counting_decode_reads = False
        self.decode_bits_read = 0.0
        self.decode_elements_read = 0
        self.decode_pages = 0
        self.decode_fp8_pages = 0

    # -- accounting ------------------------------------------------------------------------------
    def prefix_caching_unsupported(self) -> str | None:
        return ("its re-ranking rewrites full pages after they are written (FP8 pages demoted to nuq2), "
                "chosen from each sequence's own attention mass and protected pages; a shared page would "
                "change under one request because of another, so outputs would depend on which requests "
                "happened to share it")

    def sliding_window_unsupported(self) -> str | None:
        return ("does not serve sliding-window attention layers: its ranking keeps only a sequence's first "
                "and newest full pages in FP8 for sure, so it could demote pages a window still reads")

    def _slabs(self, kind: str, block_size: int, head_dim: int) -> tuple[int, int]:
        return (self.hi.layout(kind, block_size, head_dim).slab_bytes,
                self.lo.layout(kind, block_size, head_dim).slab_bytes)

    def page_bytes(self, num_kv_heads, block_size, head_dim) -> int:
        total = 0.0
        for kind in ("key", "value"):
            hi, lo = self._slabs(kind, block_size, head_dim)
            total += lo + self.fp8_pool_fraction * hi
        if self.fragment_pages(block_size, head_dim):  # the low tier in nuq2's fragment tables instead of slabs
            total += self.gluon_kernel.layout_module().fragment_bytes_per_page_head(self.lo) - sum(
                self._slabs(kind, block_size, head_dim)[1] for kind in ("key", "value"))
        return math.ceil(num_kv_heads * total)

    # -- the Gluon decode kernel's pools (gluon_kernel) ------------------------------------------------
    # Its own code, not FragmentPagedFormat's, reads them: the pools hold two tiers, the low one in
    # nuq2's fragment tables (gluon_kernel's layout, applied to self.lo) and the FP8 one as slabs in FP8
    # slots whose codes take fp8_layout's fragment order (slabs_to_fragment), not fp8's own page tables
    def tier_tables(self, cache, pool: str, kind: str, slabs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Freshly packed slabs [n, Hkv, slab] of one tier (`pool`: 'fp8' or 'low') as the rows of the
        cache tensors they fill: the slabs themselves, or in a fragment-order pool the FP8 codes
        reordered (fp8_layout.py) and the low tier's nuq2 fragment tables (nuq2_layout.py)."""
        name = "k" if kind == "key" else "v"
        if not self.is_fragment_pool(cache):
            return {f"{name}_{pool}": slabs}
        if pool == "fp8":
            from moekv.ops.gluon.fp8_layout import slabs_to_fragment

            return {f"{name}_fp8": slabs_to_fragment(self.hi, kind, slabs)}
        return self.gluon_kernel.layout_module().kind_to_fragment(self.lo, kind, slabs, cache.layer)

    def _put(self, cache, pool: str, kind: str, index: torch.Tensor, slabs: torch.Tensor) -> None:
        """Freshly packed slabs of one tier into its pool at rows `index` (FP8 slots or low-tier pages)."""
        for field, t in self.tier_tables(cache, pool, kind, slabs).items():
            cache[field][index] = t

    def _fp8_pages(self, cache, kind: str, slots: torch.Tensor) -> torch.Tensor:
        """FP8 slots dequantized: [n, Hkv, P, D] fp32."""
        name = "k" if kind == "key" else "v"
        slabs = cache[f"{name}_fp8"][slots]
        if self.is_fragment_pool(cache):
            from moekv.ops.gluon.fp8_layout import dequantize_fragment_slabs

            return dequantize_fragment_slabs(self.hi, kind, slabs)
        P, D = cache["k_staging"].shape[2], cache["k_staging"].shape[3]
        return self.hi.dequantize(self.hi.layout(kind, P, D).unpack(slabs), kind, cache.layer)

    def _low_pages(self, cache, kind: str, pages: torch.Tensor) -> torch.Tensor:
        """Low-tier pages dequantized: [n, Hkv, P, D] fp32."""
        if self.is_fragment_pool(cache):
            layout = self.gluon_kernel.layout_module()
            return layout.dequantize_fragment(layout.fragment_view(self.lo, cache, pages), kind)
        name = "k" if kind == "key" else "v"
        P, D = cache["k_staging"].shape[2], cache["k_staging"].shape[3]
        return self.lo.dequantize(self.lo.layout(kind, P, D).unpack(cache[f"{name}_low"][pages]), kind, cache.layer)

    def check_layout(self, num_kv_heads, block_size, head_dim) -> None:
        self.hi.check_layout(num_kv_heads, block_size, head_dim)
        self.lo.check_layout(num_kv_heads, block_size, head_dim)

    @property
    def measured_bits_per_element(self) -> float | None:
        return self.bits_read / self.elements_read if self.elements_read else None

    @property
    def measured_decode_bits_per_element(self) -> float | None:
        """Bits per element the decode rows read (full pages in their tiers, the staged tail at 16)."""
        return self.decode_bits_read / self.decode_elements_read if self.decode_elements_read else None

    @property
    def measured_decode_fp8_share(self) -> float | None:
        """The share of the full pages decode rows read that were in FP8."""
        return self.decode_fp8_pages / self.decode_pages if self.decode_pages else None

    def reset_read_counters(self) -> None:
        self.bits_read, self.elements_read = 0.0, 0
        self.decode_bits_read, self.decode_elements_read, self.decode_pages, self.decode_fp8_pages = 0.0, 0, 0, 0

    def read_counts(self, decode: bool = False) -> ReadCounts | None:
        if decode:
            return ReadCounts(self.decode_bits_read, self.decode_elements_read)
        return ReadCounts(self.bits_read, self.elements_read)

    def count_decode_reads(self, on: bool = True) -> None:
        self.counting_decode_reads = on

    def shard_tables(self, kv_heads, num_kv_heads) -> None:
        self.hi.shard_tables(kv_heads, num_kv_heads)
        self.lo.shard_tables(kv_heads, num_kv_heads)

    statistic_gauges = {
        "tier_share_fp8": StatisticGauge("kv_cache_tier_fraction", _TIER_DOC, (("tier", "fp8"),)),
        "tier_share_low": StatisticGauge("kv_cache_tier_fraction", _TIER_DOC, (("tier", "nuq2"),)),
        "bits_read": StatisticGauge("kv_cache_bits_per_element_read",
                                    "tiered format: bits per element attention has read so far."),
    }

    def run_statistics(self, caches) -> dict[str, float]:
        """The share of stored pages in each tier (averaged over layers) and, once attention has read
        any, the bits per element it read. From another thread the tier lists may be a step stale."""
        fp8, low = tier_shares([list(c.state.tier) for c in caches])
        out = {"tier_share_fp8": fp8, "tier_share_low": low}
        if self.measured_bits_per_element is not None:
            out["bits_read"] = self.measured_bits_per_element
        if self.measured_decode_bits_per_element is not None:
            out["bits_read_decode"] = self.measured_decode_bits_per_element
            out["fp8_share_decode"] = self.measured_decode_fp8_share
        return out

    # -- pools -----------------------------------------------------------------------------------
    def allocate(self, num_blocks, num_kv_heads, block_size, head_dim, device, max_num_seqs, dtype) -> LayerKVCache:
        num_fp8 = max(min(num_blocks, 3 * max_num_seqs), math.ceil(self.fp8_pool_fraction * num_blocks))
        t = staging_tensors(max_num_seqs, num_kv_heads, block_size, head_dim, dtype, device)
        fragment = self.fragment_pages(block_size, head_dim, device)
        for kind, name in (("key", "k"), ("value", "v")):
            hi, lo = self._slabs(kind, block_size, head_dim)
            # one slot more: the scratch slot the padded fills of a replayed step write to
            t[f"{name}_fp8"] = torch.zeros(num_fp8 + 1, num_kv_heads, hi, dtype=torch.uint8, device=device)
            if not fragment:
                t[f"{name}_low"] = torch.zeros(num_blocks, num_kv_heads, lo, dtype=torch.uint8, device=device)
        if fragment:  # nuq2's fragment tables for the low tier; FP8 codes in fragment order (zeros stay zeros)
            from moekv.ops.gluon import fp8_layout

            t.update(self.gluon_kernel.layout_module().allocate_fragment_tables(self.lo, num_blocks, num_kv_heads,
                                                                                device))
            fp8_layout.prepare_device(device)
        return LayerKVCache(t, nonfinite=torch.zeros((), dtype=torch.bool, device=device),
                            state=TieredState.empty(num_blocks, num_fp8, max_num_seqs, device))

    def _sync_pages(self, cache, pages: list[int], zero_mass: bool = False) -> None:
        """Copy the pages' tier and FP8 slot to the device mirrors (and clear their pending mass)."""
        if not pages:
            return
        st = cache.state
        dev = st.tier_dev.device
        # to_device: a plain torch.tensor(..., device=cuda) waits for the queued step (async scheduling)
        idx = to_device(pages, torch.long, dev)
        st.tier_dev[idx] = to_device([st.tier[p] for p in pages], torch.int32, dev)
        st.slot_dev[idx] = to_device([st.fp8_slot[p] for p in pages], torch.int32, dev)
        if zero_mass and st.mass_pending:
            st.mass_dev[idx] = 0.0

    def _fold_mass(self, cache) -> None:
        """Add the kernel's accumulated mass to the host scores (one device-to-host copy)."""
        st = cache.state
        if st.mass_pending:
            pages = st.mass_dev.nonzero().flatten()
            weight = st.mass_weight
            for page, m in zip(pages.tolist(), st.mass_dev[pages].tolist()):
                # only stored pages are ranked: mass on a page in no tier (free, being filled, or the
                # graph runner's scratch page that padded rows point at) is dropped
                if st.tier[page] != TIER_NONE:
                    st.mass[page] += m * weight
            st.mass_dev.zero_()
            st.mass_pending = False

    def release_pages(self, cache, pages) -> None:
        st = cache.state
        pages = list(pages)
        for page in pages:
            if st.tier[page] == TIER_FP8:
                st.free_fp8.append(st.fp8_slot[page])
            st.tier[page], st.fp8_slot[page], st.mass[page] = TIER_NONE, -1, 0.0
        self._sync_pages(cache, pages, zero_mass=True)

    # -- writing ---------------------------------------------------------------------------------
    def write(self, cache, k, v, ctx) -> None:
        st = cache.state
        if can_stage_vectorized(k, ctx):  # no page fills: one indexed copy, no host sync
            stage_decode_tokens(cache, k, v, ctx)
        elif ctx.graph_step:  # a replayed step that fills pages: their slots were chosen before it
            stage_decode_tokens(cache, k, v, ctx)
            self._store_fills_in_graph(cache, ctx)
        elif ctx.max_query_len == 1 and k.shape[0] == ctx.num_seqs:
            # a decode step that fills pages: one indexed copy, then the full staging pages are stored
            # (stage_tokens would loop over every sequence of the batch in each layer)
            stage_decode_tokens(cache, k, v, ctx)
            self._store_filled_staging(cache, ctx)
        else:
            completed: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (b, page index) -> {"k", "v"}
            for b, name, indices, pages in stage_tokens(cache, k, v, ctx):
                for page_idx, page in zip(indices, pages if indices else ()):
                    completed.setdefault((b, page_idx), {})[name] = page
            if completed:
                tables = ctx.host_lists().block_tables
                self._store_pages(cache, [(tables[b][page_idx], kv, tables[b][:page_idx + 1])
                                          for (b, page_idx), kv in completed.items()])
        if ctx.graph_step:  # warm-up, capture or replay: prepare_graph_step counts replayed steps
            return
        if st.counted_ahead:  # prepared for a replay that failed: counted (and re-ranked) already
            st.counted_ahead = False
            return
        self._count_step(cache, ctx.host_lists())

    def fused_rope_write_target(self, cache, k, ctx):
        # graph steps only: an eager step needs `write` itself (it counts the step, may re-rank)
        if not ctx.graph_step or not can_stage_vectorized(k, ctx):
            return None
        return RopeWriteTarget(cache["k_staging"], cache["v_staging"], ctx.seq_slots, staged=True)

    def quantize_filled_pages(self, caches, ctx) -> None:
        """Nothing: `write` stores the pages it fills itself, before the layer attends."""

    def _count_step(self, cache, host: HostLists) -> None:
        """The host side of a step, after its pages are stored: count it, and re-rank every
        `rerank_interval` steps."""
        cache.state.steps += 1
        if is_rerank_step(cache.state.steps, self.rerank_interval):
            self._rerank(cache, host)
        if self.counting_decode_reads:
            self._count_decode_reads(cache, host)

    def _count_decode_reads(self, cache, host: HostLists) -> None:
        """Add what this step's decode rows will read to the decode counters: each full page in its
        tier (FP8 or nuq2 slabs, keys and values) and the staged tail at 16 bits."""
        st = cache.state
        _, num_kv_heads, P, D = cache["k_staging"].shape
        hi = lo = 0
        for kind in ("key", "value"):
            h, lo_bytes = self._slabs(kind, P, D)
            hi, lo = hi + 8 * num_kv_heads * h, lo + 8 * num_kv_heads * lo_bytes
        page_elements = 2 * num_kv_heads * P * D
        starts, tier = host.query_start, st.tier
        for b, length in enumerate(host.context_lens):
            if starts[b + 1] - starts[b] != 1:
                continue
            num_full = length // P
            fp8 = [tier[page] for page in host.block_tables[b][:num_full]].count(TIER_FP8)
            tail = 2 * num_kv_heads * D * (length - num_full * P)
            self.decode_bits_read += fp8 * hi + (num_full - fp8) * lo + 16 * tail
            self.decode_elements_read += num_full * page_elements + tail
            self.decode_pages += num_full
            self.decode_fp8_pages += fp8

    # -- CUDA graphs -------------------------------------------------------------------------------
    @staticmethod
    def _release_fill_slots(caches) -> None:
        """The fill-slot buffer back to the scratch slot (queued after any replay), so a later capture's
        warm-up, which writes its padded fills there, cannot write into a real page's slot."""
        for c in caches:
            if c.state.fill_slots_loaded:
                c.state.fill_fp8_dev.fill_(c.state.scratch_fp8)
                c.state.fill_slots_loaded = False

    def after_graph_replay(self, caches) -> None:
        for c in caches:
            c.state.counted_ahead = False  # prepare_graph_step's count stands: the replay ran
            c.state.mass_pending = True  # attend_kernel's flag: the replay added to mass_dev
        self._release_fill_slots(caches)

    def graph_step_not_replayed(self, caches) -> None:
        """The step prepare_graph_step prepared runs eagerly instead (or fails): the fill slots go back
        to the scratch slot. The rest stands, and the eager `write` of the same step is consistent
        with it: it counts nothing (counted_ahead) and stores the fills again, releasing the FP8 slots
        prepared for them and taking free ones (no demotion: the prepared demotions made the room),
        so the tiers it attends are those the eager step alone would have left."""
        self._release_fill_slots(caches)

    def prepare_graph_step(self, caches, host: HostLists, fill_pages: list[int], first_pages: list[int]) -> bool:
        """Before a replayed step, what its eager `write` would do on the host, in the same order:
        store its fills (_prepare_fills), then count the step and maybe re-rank (_count_step).
        False (fills the captured step cannot take) leaves everything as it was."""
        if fill_pages and not self._prepare_fills(caches, fill_pages, first_pages):
            return False
        for c in caches:
            self._count_step(c, host)
            c.state.counted_ahead = True  # if the replay fails, the eager step must not count again
        return True

    def _prepare_fills(self, caches, fill_pages: list[int], first_pages: list[int]) -> bool:
        """For a replayed step that fills `fill_pages` (first_pages: each one's sequence's first
        page): choose each layer's FP8 slots on the host as `write` would (demoting the coldest
        pages, re-encoded now, before the step), mirror the tiers to the device and put the slots
        where the captured write reads them. False, with the page state as it was, when some
        layer would send a fill straight to nuq2 (no slot to give, or a later fill demoting an
        earlier one of the same step), which the captured step cannot do: it then runs eagerly."""
        pages = [(page, [first, page]) for page, first in zip(fill_pages, first_pages)]
        chosen = []
        for c in caches:
            st = c.state
            # a recomputed page starts over (the others are in no tier: nothing to release)
            self.release_pages(c, [p for p in fill_pages if st.tier[p] != TIER_NONE])
            before = (list(st.tier), list(st.fp8_slot), list(st.free_fp8))
            chosen.append((c, before, self._choose_tiers(c, pages)))
        if any(to_low for _, _, (_, to_low, _) in chosen):
            for c, (tier, fp8_slot, free_fp8), _ in chosen:
                c.state.tier, c.state.fp8_slot, c.state.free_fp8 = tier, fp8_slot, free_fp8
            return False
        for c, _, (to_fp8, _, demoted) in chosen:
            st = c.state
            self._reencode_low(c, [p for p, _ in demoted], [slot for _, slot in demoted])
            slots = [to_fp8[page] for page in fill_pages]
            pad = st.fill_fp8_dev.numel() - len(slots)
            st.fill_fp8_dev.copy_(to_device(slots + [st.scratch_fp8] * pad, torch.long, st.fill_fp8_dev.device))
            self._sync_pages(c, [p for p, _ in demoted] + fill_pages)
            st.fill_slots_loaded = True
        return True

    def _store_fills_in_graph(self, cache, ctx: Context) -> None:
        """Inside a replayed step: the staging pages it completed (ctx.fill_slots, padded with the
        scratch slot) quantized to FP8 into the slots _prepare_fills chose (fill_fp8_dev)."""
        F = ctx.fill_slots.numel()
        dest = cache.state.fill_fp8_dev[:F]
        for name, kind in (("k", "key"), ("v", "value")):
            x = cache[f"{name}_staging"][ctx.fill_slots]  # [F, Hkv, P, D]
            flag_nonfinite(cache, x)
            self._put(cache, "fp8", kind, dest, self.hi.quantize_packed(x, kind, cache.layer))

    def _store_filled_staging(self, cache, ctx: Context) -> None:
        """After a decode step's tokens are staged: store the staging pages they completed."""
        host = ctx.host_lists()
        P = cache["k_staging"].shape[2]
        filled = filling_rows(host.context_lens, P)
        if not filled:
            return
        slots = to_device([host.seq_slots[b] for b in filled], torch.long, cache["k_staging"].device)
        k_pages, v_pages = cache["k_staging"][slots].float(), cache["v_staging"][slots].float()
        tables = [host.block_tables[b][:host.context_lens[b] // P] for b in filled]
        self._store_pages(cache, [(table[-1], {"k": k_pages[i], "v": v_pages[i]}, table)
                                  for i, table in enumerate(tables)])

    def _store_pages(self, cache, pages: list[tuple[int, dict[str, torch.Tensor], list[int]]]) -> None:
        """Store filled pages, each (page, {"k", "v"}: [Hkv, P, D], the sequence's pages up to it), in
        FP8 slots: a page takes a free slot; with none free, the coldest FP8 page outside the
        sequence's first and this one gives up its slot (is demoted), and if every FP8 page is
        protected the page goes straight to nuq2 (_choose_tiers).

        The tiers are chosen page by page on the host; the device work follows in bulk. With the
        FP8 pool full, as it is from the first quarter of a long prompt on, each page of a prefill
        demotes one: per page, that would be a flush, a fold of the masses (a sync), a scan of every
        FP8 page and a one-page re-encode (docs/decisions.md: the formats' host work in bulk)."""
        self.release_pages(cache, [page for page, _, _ in pages])  # a recomputed page starts over
        for name, kind in (("k", "key"), ("v", "value")):
            check_finite(torch.stack([kv[name] for _, kv, _ in pages]), kind + "s")
        data = {page: kv for page, kv, _ in pages}
        slots, to_low, demoted = self._choose_tiers(cache, [(page, protect) for page, _, protect in pages])
        to_fp8 = {page: (data[page], slot) for page, slot in slots.items()}
        to_low = {page: data[page] for page in to_low}
        # the demoted pages' FP8 slabs are read before this batch's pages take over their slots
        self._reencode_low(cache, [p for p, _ in demoted], [slot for _, slot in demoted])
        device = cache["k_staging"].device
        for pool, fmt, rows, kvs in (("fp8", self.hi, [slot for _, slot in to_fp8.values()],
                                      [kv for kv, _ in to_fp8.values()]),
                                     ("low", self.lo, list(to_low), list(to_low.values()))):
            if not rows:
                continue
            index = to_device(rows, torch.long, device)
            for name, kind in (("k", "key"), ("v", "value")):
                x = torch.stack([kv[name] for kv in kvs])  # [n, Hkv, P, D]
                self._put(cache, pool, kind, index, fmt.quantize_packed(x, kind, cache.layer))
        self._sync_pages(cache, [p for p, _ in demoted] + list(to_fp8) + list(to_low))

    def _choose_tiers(self, cache, pages: list[tuple[int, list[int]]]):
        """The host side of storing pages (page, its sequence's pages up to it): tiered_policy's
        choose_tiers on this layer's page state, with the kernel's mass folded in when it is read."""
        st = cache.state

        def current_mass() -> list[float]:
            self._fold_mass(cache)
            return st.mass

        return choose_tiers(pages, st.tier, st.fp8_slot, st.free_fp8, current_mass)

    def _reencode_low(self, cache, pages: list[int], slots: list[int]) -> None:
        """Device work of a demotion: the FP8 slabs in `slots` re-encoded into nuq2 as `pages`."""
        if not pages:
            return
        device = cache["k_staging"].device
        slot_idx = to_device(slots, torch.long, device)
        page_idx = to_device(pages, torch.long, device)
        for name, kind in (("k", "key"), ("v", "value")):
            x = self._fp8_pages(cache, kind, slot_idx)
            self._put(cache, "low", kind, page_idx, self.lo.quantize_packed(x, kind, cache.layer))

    def _demote(self, cache, pages: list[int]) -> None:
        """Re-encode FP8 pages into nuq2 (in their low-pool slots) and free their FP8 slots, all of
        them in one batch (a re-ranking at a long context demotes tens of pages a layer, each a
        re-encode of its own one at a time: docs/decisions.md, the formats' host work in bulk)."""
        if not pages:
            return
        st = cache.state
        slots = [st.fp8_slot[page] for page in pages]
        self._reencode_low(cache, pages, slots)
        for page, slot in zip(pages, slots):
            st.free_fp8.append(slot)
            st.tier[page], st.fp8_slot[page] = TIER_LOW, -1
        self._sync_pages(cache, pages)

    def _rerank(self, cache, host: HostLists) -> None:
        """Per sequence in this step (host: its tables): keep the top pages by mass, the first and
        the newest full page in FP8; demote the rest. Masses then halve, so that the ranking follows
        recent attention."""
        st = cache.state
        self._fold_mass(cache)
        block_size = cache["k_staging"].shape[2]
        starts = host.query_start
        full_pages = [host.block_tables[b][:length // block_size] for b, length in enumerate(host.context_lens)
                      if not self.rank_after_prompt or starts[b + 1] - starts[b] == 1]
        self._demote(cache, rerank_demotions(full_pages, st.tier, st.mass, self.tier1_fraction))
        # the weight doubles instead of every mass halving: a pass over every page of the pool only when
        # the weight grows large (docs/decisions.md: the formats' host work in bulk)
        st.mass, st.mass_weight = decayed_weight(st.mass, st.mass_weight)

    def page_mass(self, cache, page: int) -> float:
        """A page's decayed attention mass (what the ranking compares), pending mass folded in."""
        self._fold_mass(cache)
        return cache.state.mass[page] / cache.state.mass_weight

    # -- reading ---------------------------------------------------------------------------------
    def _gather_pages(self, cache, pages: list[int], kind: str) -> torch.Tensor:
        """Dequantize logical pages from whichever tier holds them -> [n, Hkv, P, D] fp32."""
        st = cache.state
        P, D = cache["k_staging"].shape[2], cache["k_staging"].shape[3]
        Hkv = cache["k_staging"].shape[1]
        out = torch.empty(len(pages), Hkv, P, D, device=cache["k_staging"].device)
        for tier, read, slab in ((TIER_FP8, self._fp8_pages, 0), (TIER_LOW, self._low_pages, 1)):
            idx = [i for i, p in enumerate(pages) if st.tier[p] == tier]
            if not idx:
                continue
            rows = [st.fp8_slot[pages[i]] if tier == TIER_FP8 else pages[i] for i in idx]
            out[to_device(idx, torch.long, out.device)] = read(cache, kind, to_device(rows, torch.long, out.device))
            self.bits_read += 8 * len(idx) * Hkv * self._slabs(kind, P, D)[slab]  # the slabs' bytes
            self.elements_read += len(idx) * out.shape[1] * P * D
        return out

    def gather(self, cache, ctx, b, length, kind):
        """Sequence b's first `length` (1 <= length <= context_lens[b]) tokens of K or V: full pages
        from their tiers (`write` stores a page before the layer attends, the newest one too), the
        partial newest page from staging. [length, Hkv, D] fp32."""
        P, D = cache["k_staging"].shape[2], cache["k_staging"].shape[3]
        host = ctx.host_lists()
        num_full = min(-(-length // P), host.context_lens[b] // P)
        parts = []
        if num_full:
            pages = host.block_tables[b][:num_full]
            x = self._gather_pages(cache, pages, kind)
            parts.append(x.permute(0, 2, 1, 3).reshape(num_full * P, -1, D)[:length])
        tail = length - num_full * P
        if tail > 0:
            name = "k" if kind == "key" else "v"
            parts.append(cache[f"{name}_staging"][host.seq_slots[b], :, :tail].transpose(0, 1).float())
            self.bits_read += 16 * tail * cache["k_staging"].shape[1] * D
            self.elements_read += tail * cache["k_staging"].shape[1] * D
        return torch.cat(parts)

    def fused_decode_unavailable(self, block_size, head_dim):
        """use_kernel's conditions that a step's shape and options fix (the rest: CUDA, fp16/bf16
        queries, decode-only, are the graph runner's too)."""
        if not self.fused_decode:
            return "has fused_decode=False (reference path)"
        if self.lo.calibrated:
            return "uses calibrated nuq2 codebooks, which its fused decode kernel does not read (reference path)"
        if not _kernel_shape_ok(block_size, head_dim):
            return (f"has no fused decode kernel at block_size={block_size}, head_dim={head_dim} (it needs a "
                    "multiple of 16 and a power of two >= 16; reference path)")
        return None

    def use_kernel(self, q, ctx, cache=None) -> bool:
        """With fused_decode, decode-only steps on CUDA in fp16/bf16 with page codebooks take the fused
        kernel (pages of a multiple of 16 tokens, a power-of-two head_dim >= 16: what its tiles need)."""
        P = cache["k_staging"].shape[2] if cache is not None else 16
        return (self.fused_decode and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                and not self.lo.calibrated and _kernel_shape_ok(P, q.shape[-1]) and is_decode_only(q, ctx))

    def attend(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        """Decode-only steps on CUDA: the fused kernel over both tiers (attend_kernel: the Gluon one
        when the pools are in fragment order, attend_gluon, a query group beyond its 8 in parts, each
        reading the pages once and adding its heads' page mass: attend_in_group_parts); otherwise (CPU,
        prefill) attend_reference. Sliding-window layers are refused before this (sliding_window_unsupported)."""
        if self.use_kernel(q, ctx, cache):
            if not self.is_fragment_pool(cache):
                return self.attend_kernel(q, cache, ctx, scale, sliding_window, sinks=sinks)
            # the mass is a sum over query heads, each head's share from its own softmax: the parts' masses
            # add up in the accumulator to the whole group's
            return attend_in_group_parts(q, cache["k_staging"].shape[1], sinks, lambda q_part, sinks_part:
                                         self.attend_gluon(q_part, cache, ctx, scale, sliding_window, sinks=sinks_part))
        return self.attend_reference(q, cache, ctx, scale, sliding_window, step_kv, sinks)

    def attend_gluon(self, q, cache, ctx, scale, sliding_window, **launch):
        """One query per sequence through moekv/ops/gluon/tiered_decode.py (pools in fragment order; a
        query group the kernel takes, 1, 2, 4 or 8): both tiers and the staged tail in one launch, the
        per-page mass of q's heads added to the device accumulator as attend_kernel's. launch:
        num_splits, max_registers, sinks."""
        low = self.gluon_kernel.layout_module().fragment_view(self.lo, cache)
        st = cache.state
        out, _ = self.gluon_kernel.decode_entry()(q, low, cache["k_fp8"], cache["v_fp8"], st.tier_dev, st.slot_dev,
                                                  ctx.block_tables, ctx.context_lens, scale, fp8_fmt=self.hi,
                                                  staged=(cache["k_staging"], cache["v_staging"], ctx.seq_slots),
                                                  sliding_window=sliding_window, mass_into=st.mass_dev, **launch)
        st.mass_pending = True
        return out

    def attend_kernel(self, q, cache, ctx, scale, sliding_window, **launch):
        """One query per sequence through moekv/ops/decode/tiered.py: both tiers in one launch; the
        per-page attention mass it emits (summed over query heads, full pages only: the reference's
        definition) goes to the device accumulator, without a sync. launch: num_splits, block_n, ..."""
        from moekv.ops.decode.tiered import tiered_decode_attention

        st = cache.state
        out, _ = tiered_decode_attention(q, cache, st.tier_dev, st.slot_dev, ctx.block_tables,
                                         ctx.context_lens, ctx.seq_slots, scale, sliding_window,
                                         self.hi, self.lo, mass_into=st.mass_dev, **launch)
        st.mass_pending = True  # host-side: a replay skips it (after_graph_replay sets it)
        return out

    def attend_reference(self, q, cache, ctx, scale, sliding_window, step_kv=None, sinks=None):
        """Attention as every format's reference path computes it (dense_attention: SDPA over the
        dequantized context, flash on CUDA; a prefill chunk's own tokens exact, dense.with_step_kv),
        and each full page's attention mass beside it, over the keys attention read (key_mass: the
        probabilities summed over heads and queries, a chunk of queries at a time, scoring only the
        keys each chunk can see, so the mass costs a fraction of the attention)."""
        st = cache.state
        P = cache["k_staging"].shape[2]
        host = ctx.host_lists()
        starts = host.query_start
        # bits_read counts what gather reads from the cache (a chunk's own K/V, taken from step_kv, not)
        read = with_step_kv(lambda b, n: (self.gather(cache, ctx, b, n, "key"), self.gather(cache, ctx, b, n, "value")),
                            ctx, step_kv, cache.staged_before_step)

        def gather_and_rank(b, length):
            k, v = read(b, length)
            num_full = length // P
            if num_full:
                lo = starts[b] if not self.rank_window else max(starts[b], starts[b + 1] - self.rank_window)
                mass = key_mass(q[lo:starts[b + 1]], k, scale, sliding_window, num_full * P)
                # into the device accumulator the fused kernel adds to, folded into the host scores
                # when they are read (_fold_mass): no device-to-host copy per sequence and layer (on
                # CUDA each would be a sync: docs/decisions.md, the formats' host work in bulk)
                pages = to_device(host.block_tables[b][:num_full], torch.long, st.mass_dev.device)
                st.mass_dev.index_add_(0, pages, mass.reshape(num_full, P).sum(-1))
                st.mass_pending = True
            return k, v

        return dense_attention(q, ctx, gather_and_rank, scale, sliding_window, sinks)


def key_mass(q: torch.Tensor, k: torch.Tensor, scale: float, sliding_window: int | None, num_keys: int,
             max_elements: int = 1 << 26) -> torch.Tensor:
    """The attention probability of each of the first `num_keys` keys, summed over query heads and
    queries: q [Tq, Hq, D] (the last Tq positions of the context), k [L, Hkv, D] -> [num_keys] fp32.
    Causal (and sliding-window) masking as the attention's; fp32 softmax over [Hkv, G, C, n] score
    chunks of C queries (C * Hq * L <= max_elements), so no [Hq, Tq, L] tensor is ever held. A
    chunk scores only the n keys some query of it can see (for a whole prompt, half the keys on
    average) and masks only the columns where some query may not look."""
    num_q, num_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    k_t = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    mass = torch.zeros(num_keys, dtype=torch.float32, device=q.device)
    chunk = max(1, max_elements // (num_heads * length))
    for c0 in range(0, num_q, chunk):
        C = min(chunk, num_q - c0)
        p0 = length - num_q + c0  # the chunk's first query position; its keys are [lo, hi)
        hi = p0 + C
        lo = 0 if sliding_window is None else max(0, p0 - sliding_window + 1)
        if lo >= num_keys:
            continue
        q_c = q[c0:c0 + C].float() * scale
        q_g = q_c.reshape(C, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * C,
                                                                                          head_dim)
        scores = torch.bmm(q_g, k_t[:, :, lo:hi]).view(num_kv_heads, group, C, hi - lo)
        q_pos = torch.arange(p0, hi, device=q.device)[:, None]
        # keys at p0 and later are past some query's position; keys up to hi - 1 - window are
        # outside some query's window: only those columns take the mask
        masked = [(max(p0, lo), hi)]
        if sliding_window is not None:
            masked.append((lo, min(hi, hi - sliding_window)))
        for a, b in masked:
            if a < b:
                k_pos = torch.arange(a, b, device=q.device)[None, :]
                blocked = k_pos > q_pos
                if sliding_window is not None:
                    blocked |= k_pos <= q_pos - sliding_window
                scores[..., a - lo:b - lo].masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        end = min(hi, num_keys)
        mass[lo:end] += probs[..., :end - lo].sum(dim=(0, 1, 2))
    return mass


def _kernel_shape_ok(block_size: int, head_dim: int) -> bool:
    """What the compiled fused kernel's tiles need: pages of a multiple of 16 tokens (its tiles lie in
    one page and are at least 16 tokens, the MMA's smallest), a power-of-two head_dim >= 16."""
    return block_size % 16 == 0 and head_dim >= 16 and head_dim & (head_dim - 1) == 0
