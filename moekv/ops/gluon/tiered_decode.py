"""Split-K paged decode attention over a tiered layer in fragment order, with a Gluon kernel: FP8
pages and nuq2 pages in one launch, the per-page attention mass tiered's re-ranking needs.

A tiered layer maps each logical page (the block manager's id, what block_tables hold) to a tier
(`page_tier` [N] int32: 1 FP8, 2 nuq2, 0 none) and, for FP8, a slot in the FP8 pool (`page_slot`
[N]). In fragment order the low tier is nuq2's fragment tables over all N logical pages
(nuq2_layout.Nuq2FragmentPages, page codebooks) and the FP8 tier fp8_e4m3 slabs [F, Hkv, slab] with
their codes in FP8 fragment order (fp8_layout.py). The kernel (tiered_kernel.py) branches per page
on the tier: nuq2 pages as nuq2's Gluon kernel computes them, FP8 pages as e4m3 codes converted in
registers with their row scales; the staged tail (tiered stages only the partly filled newest page:
tokens from (len // 64) * 64 on) is one more split, and sliding windows skip and mask as nuq2's do.

Mass: per page and query head, tile_sum = sum over the page's tokens of 2^(s - m) and tile_max = m,
the split's running max after the page (base-2 scores s); with the head's final log2-sum-exp L the
page's share of that head's attention is tile_sum * 2^(tile_max - L). `page_mass` sums it over the
query heads of each sequence's full pages (what TieredFormat ranks); on the GPU
moekv/ops/decode/tiered.py's reduce_and_mass_kernel does the reduce and this in one launch.

`tiered_decode_split_reference` is the oracle (plain PyTorch over the dequantized fragment tables:
the same splits, partials and mass); `tiered_decode_attention` runs the kernel and the reduce (CUDA
sm_80+ with Gluon).
"""
from __future__ import annotations

import math

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.checks import Staged, check_extras, check_inputs
from moekv.ops.gluon.fp8_decode import fp8_pool_args
from moekv.ops.gluon.fp8_layout import dequantize_fragment_slabs
from moekv.ops.gluon.launch import check_launch, gluon_missing, plan_launch, reduce_on_device, register_cap
from moekv.ops.gluon.nuq2_decode import DEFAULT_SLOT_CHUNK0
from moekv.ops.gluon.nuq2_layout import (
    FRAGMENT_FIELDS,
    HEAD_DIM,
    PAGE_TOKENS,
    Nuq2FragmentPages,
    dequantize_fragment,
    slot_tables,
)
from moekv.ops.gluon.splits import masked, split_ranges, staged_scores, window_start
from moekv.ops.tiers import TIER_FP8

# an FP8 page's steps without the next step's loads in flight (unmeasured: bench_decode_attention's
# tiered_gluon row times the other choice, fp8_prefetch_ms)
DEFAULT_FP8_PREFETCH = False
# the kernel's SMEM: the next nuq2 page staged in shared memory by cp.async (nuq2's SMEM), FP8 pages not.
# None: when the launch fills a wave of the GPU (Launch.fills_wave); a small launch (batch 1 at 4k) loses to
# it (docs/decisions.md, "Pages through shared memory where the launch fills the GPU")
DEFAULT_SMEM = None

# ptxas's cap of the tiered kernel (nuq2's page tile with global loads; docs/decisions.md, "Pages through
# shared memory where the launch fills the GPU")
DEFAULT_MAX_REGISTERS = 128


def staged_quantized(length: int, staged: bool) -> int:
    """Tokens [0, quantized) are read from pages: tiered stores a page when it fills, so with a
    staged tail only the partly filled newest page is staged."""
    return (length // PAGE_TOKENS) * PAGE_TOKENS if staged else length


def _check_tiers(frag: Nuq2FragmentPages, k_fp8: torch.Tensor, v_fp8: torch.Tensor, page_tier: torch.Tensor,
                 page_slot: torch.Tensor) -> None:
    N, Hkv = frag.k_codes.shape[:2]
    if page_tier.shape != (N,) or page_slot.shape != (N,):
        raise ValueError(f"tiered Gluon decode: page_tier and page_slot must be [N={N}], got "
                         f"{tuple(page_tier.shape)} and {tuple(page_slot.shape)}")
    if k_fp8.dim() != 3 or k_fp8.shape[1] != Hkv or v_fp8.shape[:2] != k_fp8.shape[:2]:
        raise ValueError(f"tiered Gluon decode: FP8 pools must be [F, Hkv={Hkv}, slab], got "
                         f"{tuple(k_fp8.shape)} and {tuple(v_fp8.shape)}")
    if frag.calibrated:
        raise ValueError("tiered Gluon decode: the low tier's nuq2 must use page codebooks")


def _dense_pages(frag, k_fp8, v_fp8, fp8_fmt, page_tier, page_slot, pages: torch.Tensor, dtype):
    """Pages (logical ids) dequantized from their tiers: K, V [n, Hkv, 64, 128] in dtype."""
    tier = page_tier[pages].long()
    sub = _sub(frag, pages)
    k = dequantize_fragment(sub, "key").to(dtype)
    v = dequantize_fragment(sub, "value").to(dtype)
    fp8 = (tier == TIER_FP8).nonzero().flatten()
    if fp8.numel():
        slots = page_slot[pages[fp8]].long()
        k[fp8] = dequantize_fragment_slabs(fp8_fmt, "key", k_fp8[slots]).to(dtype)
        v[fp8] = dequantize_fragment_slabs(fp8_fmt, "value", v_fp8[slots]).to(dtype)
    return k, v


def _sub(frag: Nuq2FragmentPages, pages: torch.Tensor) -> Nuq2FragmentPages:
    """The fragment tables of `pages` only."""
    return Nuq2FragmentPages(**{f: getattr(frag, f)[pages] for f in FRAGMENT_FIELDS}, calibrated=frag.calibrated)


def tiered_decode_split_reference(q: torch.Tensor, frag: Nuq2FragmentPages, k_fp8: torch.Tensor, v_fp8: torch.Tensor,
                                  page_tier: torch.Tensor, page_slot: torch.Tensor, block_tables: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float, num_splits: int, fp8_fmt=None,
                                  staged: Staged | None = None, sliding_window: int | None = None):
    """The Gluon kernel's partials and page masses, split by split, in q's dtype -> (part_o [B, Hq,
    NS (+1), D], part_lse [B, Hq, NS (+1)], tile_sum, tile_max [B, Hq, max_pages]); tile entries of
    pages no split reads are 0 and -inf. fp8_fmt: the FP8 tier's format (TieredFormat.hi; required,
    a keyword: ops do not import the formats)."""
    if fp8_fmt is None:
        raise ValueError("tiered Gluon decode: fp8_fmt (the FP8 tier's format, TieredFormat.hi) is required")
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits, "tiered")
    check_extras(staged, sliding_window, B, Hkv)
    _check_tiers(frag, k_fp8, v_fp8, page_tier, page_slot)
    Hq, dt = q.shape[1], q.dtype
    ns_total = num_splits + (staged is not None)
    max_pages = block_tables.shape[1]
    part_o = torch.zeros(B, Hq, ns_total, HEAD_DIM, dtype=dt, device=q.device)
    part_lse = torch.full((B, Hq, ns_total), -math.inf, dtype=dt, device=q.device)
    tile_sum = torch.zeros(B, Hq, max_pages, dtype=dt, device=q.device)
    tile_max = torch.full((B, Hq, max_pages), -math.inf, dtype=dt, device=q.device)
    qk2 = scale * LOG2E

    def store(b, sp, s, v):  # s [H, G, T] base-2 scores (-inf masked), v [H, T, D]
        m = s.amax(-1, keepdim=True)
        p = torch.exp2(s - m)
        mass = p.sum(-1)
        part_o[b, :, sp] = (torch.einsum("hgt,htd->hgd", p, v) / mass[..., None]).reshape(Hq, HEAD_DIM)
        part_lse[b, :, sp] = (m[..., 0] + torch.log2(mass)).reshape(Hq)

    for b, length in enumerate(context_lens.tolist()):
        quantized = staged_quantized(length, staged is not None)
        first = window_start(length, sliding_window)
        qg = q[b].reshape(Hkv, G, HEAD_DIM)
        for sp, p0, p1 in split_ranges(quantized, first, num_splits):
            pages = block_tables[b, p0:p1].long()
            n = p1 - p0
            k, v = _dense_pages(frag, k_fp8, v_fp8, fp8_fmt, page_tier, page_slot, pages, dt)
            s = torch.einsum("hgd,nhtd->nhgt", qg, k) * qk2  # [n, H, G, 64]
            s = masked(s, p0, p1, quantized, first)
            # the mass: each page's probabilities relative to the split's running max after it
            m_run = s.amax(-1).cummax(0).values  # [n, H, G]
            tile_sum[b, :, p0:p1] = torch.exp2(s - m_run[..., None]).sum(-1).permute(1, 2, 0).reshape(Hq, n)
            tile_max[b, :, p0:p1] = m_run.permute(1, 2, 0).reshape(Hq, n)
            store(b, sp, s.permute(1, 2, 0, 3).reshape(Hkv, G, n * PAGE_TOKENS),
                  v.permute(1, 0, 2, 3).reshape(Hkv, n * PAGE_TOKENS, HEAD_DIM))
        if staged is not None and length > quantized:  # an empty tail (a length on a page boundary) stays empty
            store(b, num_splits, *staged_scores(qg, staged, b, quantized, length, first, qk2))
    return part_o, part_lse, tile_sum, tile_max


def page_mass(part_lse: torch.Tensor, tile_sum: torch.Tensor, tile_max: torch.Tensor, context_lens: torch.Tensor,
              sliding_window: int | None = None) -> torch.Tensor:
    """mass [B, max_pages]: per full page of each sequence (pages from the window's first on), its
    attention probability summed over the query heads (reduce_and_mass_kernel's definition); 0 for
    the partly filled page, pages before the window and pages past the context."""
    top = part_lse.amax(-1, keepdim=True)
    lse = top[..., 0] + torch.log2(torch.exp2(part_lse - top).sum(-1))  # [B, Hq]
    share = torch.where(tile_sum > 0, tile_sum * torch.exp2(tile_max - lse[..., None]), 0.0).sum(1)
    mass = torch.zeros_like(share)
    for b, length in enumerate(context_lens.tolist()):
        lo = window_start(length, sliding_window) // PAGE_TOKENS
        full = length // PAGE_TOKENS
        if lo < full:
            mass[b, lo:full] = share[b, lo:full]
    return mass


# -- the GPU path ------------------------------------------------------------------------------------
def tiered_decode_partials(q: torch.Tensor, frag: Nuq2FragmentPages, k_fp8: torch.Tensor, v_fp8: torch.Tensor,
                           page_tier: torch.Tensor, page_slot: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                           fp8_fmt=None, staged: Staged | None = None, sliding_window: int | None = None,
                           emit_mass: bool = True, max_registers: int | None = DEFAULT_MAX_REGISTERS,
                           slot_chunk0: bool = DEFAULT_SLOT_CHUNK0, fp8_prefetch: bool = DEFAULT_FP8_PREFETCH,
                           smem: bool | None = DEFAULT_SMEM):
    """The Gluon kernel's outputs (part_o, part_lse, tile_sum, tile_max), fp32 (CUDA only); with
    `staged`, split num_splits holds the 16-bit tail; without emit_mass tile_sum / tile_max are None.
    Tile entries of pages no split reads are not written. fp8_prefetch: an FP8 page's next 16-token
    step loads while this one computes (fp8_kernel.fp8_page); smem: the nuq2 pages staged in shared
    memory (None: when the launch fills a wave, Launch.fills_wave)."""
    if fp8_fmt is None:
        raise ValueError("tiered Gluon decode: fp8_fmt (the FP8 tier's format, TieredFormat.hi) is required")
    B, Hkv, G = check_launch("tiered", q, frag, block_tables, context_lens, num_splits, staged, sliding_window)
    _check_tiers(frag, k_fp8, v_fp8, page_tier, page_slot)
    fp8_pools, fp8_constants = fp8_pool_args("tiered Gluon decode", fp8_fmt, k_fp8, v_fp8)
    try:
        from moekv.ops.gluon.tiered_kernel import tiered_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("tiered", e) from e
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers)
    if smem is None:
        smem = run.fills_wave
    max_pages = block_tables.shape[1]
    if emit_mass:
        tile_sum = torch.empty(B, q.shape[1], max_pages, dtype=torch.float32, device=q.device)
        tile_max = torch.empty_like(tile_sum)
    else:
        tile_sum = tile_max = run.part_lse
    tiered_decode_kernel[run.grid](
        frag.k_codes, frag.v_codes, frag.k_centroids.view(torch.int32), frag.v_centroids.view(torch.int32),
        frag.k_mean, frag.k_scale, *slot_tables(frag),
        *fp8_pools, page_tier, page_slot,
        q.contiguous(), block_tables, block_tables.stride(0), context_lens, run.seq_slots,
        run.k_stage, run.v_stage, *run.stage_strides,
        run.part_o, run.part_lse, tile_sum, tile_max, max_pages, scale * LOG2E, run.window, 0, run.num_splits,
        run.ns_total, HKV=Hkv, G=G, STAGED=staged is not None, CHUNK0=bool(slot_chunk0), EMIT_MASS=bool(emit_mass),
        **fp8_constants, FP8_PREFETCH=bool(fp8_prefetch), SMEM=bool(smem), num_warps=1, **register_cap(max_registers))
    if not emit_mass:
        return run.part_o, run.part_lse, None, None
    return run.part_o, run.part_lse, tile_sum, tile_max


def tiered_decode_attention(q: torch.Tensor, frag: Nuq2FragmentPages, k_fp8: torch.Tensor, v_fp8: torch.Tensor,
                            page_tier: torch.Tensor, page_slot: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                            fp8_fmt=None, staged: Staged | None = None, sliding_window: int | None = None,
                            emit_mass: bool = True, mass_into: torch.Tensor | None = None,
                            out: torch.Tensor | None = None, max_registers: int | None = DEFAULT_MAX_REGISTERS,
                            fp8_prefetch: bool = DEFAULT_FP8_PREFETCH, smem: bool | None = DEFAULT_SMEM,
                            sinks: torch.Tensor | None = None):
    """Decode attention of q [B, Hq, 128] over a tiered layer in fragment order -> (out [B, Hq, 128]
    in q's dtype, mass [B, max_pages] fp32 or None): the Gluon kernel, then one launch of the reduce
    and the page mass (moekv/ops/decode/tiered.py's reduce_and_mass_kernel, a tile per page);
    mass_into: a [N] fp32 accumulator the mass is added to at each page's id instead (then None);
    sinks [Hq]: each head's sink logit, joining the reduce (the mass leaves the sink's share out)."""
    part_o, part_lse, tile_sum, tile_max = tiered_decode_partials(
        q, frag, k_fp8, v_fp8, page_tier, page_slot, block_tables, context_lens, scale, num_splits, fp8_fmt,
        staged, sliding_window, emit_mass, max_registers, fp8_prefetch=fp8_prefetch, smem=smem)
    out = torch.empty_like(q) if out is None else out
    if not emit_mass:
        return reduce_on_device(part_o, part_lse, out, sinks), None
    import triton

    from moekv.ops.decode.common import NO_WINDOW
    from moekv.ops.decode.paged import check_sinks
    from moekv.ops.decode.tiered import mass_block_pages, reduce_and_mass_kernel

    B, Hq = q.shape[:2]
    check_sinks(sinks, Hq, q.device)
    max_pages = block_tables.shape[1]
    ns_total = part_o.shape[2]
    mass = mass_into if mass_into is not None else torch.empty(B, max_pages, dtype=torch.float32, device=q.device)
    block_pages = mass_block_pages(Hq, 1)
    window = NO_WINDOW if sliding_window is None else int(sliding_window)
    reduce_and_mass_kernel[(B, Hq + triton.cdiv(max_pages, block_pages))](
        part_o, part_lse, out, out.stride(0), out.stride(1),
        tile_sum, tile_max, mass, context_lens, block_tables, block_tables.stride(0), window,
        ns_total, max_pages, max_pages, Hq, max(2, triton.next_power_of_2(ns_total)), HEAD_DIM, 1, PAGE_TOKENS,
        PAGE_TOKENS, block_pages, mass_into is not None, sinks, sinks is not None, num_warps=4)
    return out, (None if mass_into is not None else mass)
