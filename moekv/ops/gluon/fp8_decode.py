"""Split-K paged decode attention over fp8_e4m3 pages in fragment order, with a Gluon kernel.

fp8_e4m3 stores k[t, c] = code[t, c] * ks[t] (e4m3 codes, one fp16 scale per token; values the same,
vs[t]). Per 64-token page, 16 tokens a step, the Gluon kernel (fp8_kernel.py) computes, exactly as
this module's reference does:

  scores   S^T [16, 8]  = ks[t] * (codes_K [16, 128] @ q^T [128, 8])      (the codes exact in fp16)
  values   O^T [128, 8] += v_max * (codes_V^T [128, 16] @ (P^T * vs / v_max) [16, 8])

with v_max the step's largest value scale (P's rows scaled by vs / v_max keep fp16's precision). The
staged 16-bit tail (the newest page, even when full) is one more split of the same launch; sliding
windows skip the pages before the window and mask inside the first one. Each split writes its partial
(o, lse in base 2) as moekv/ops/decode/paged.py's reduce reads them.

`fp8_decode_split_reference` is the oracle (plain PyTorch over the dequantized pages: the same splits
and partials); `fp8_decode_attention` runs the kernel and the reduce (CUDA sm_89+ with Gluon: the
conversion is cvt.rn.f16x2.e4m3x2).
Shapes: q [B, Hq, 128]; block_tables [B, max_pages] int32; context_lens [B]; G = Hq / Hkv in {1, 2, 4,
8}; staged = (k_stage, v_stage, seq_slots) [S, Hkv, 64, 128] 16-bit and [B].
"""
from __future__ import annotations

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.checks import Staged, check_extras, check_inputs
from moekv.ops.gluon.fp8_layout import FP8FragmentPages, dequantize_fragment, scale_offset
from moekv.ops.gluon.launch import check_launch, gluon_missing, plan_launch, reduce_on_device, register_cap
from moekv.ops.gluon.splits import split_reference

# ptxas's register cap: tiered's FP8 page path fits 128 without spills (16 one-warp programs an SM)
DEFAULT_MAX_REGISTERS = 128
# an FP8 page's next 16-token step loaded while this one computes (fp8_kernel.fp8_page's
# FP8_PREFETCH): off, it did not pay (docs/decisions.md, "fp8_e4m3 keeps its Triton kernel");
# bench_decode_attention's fp8_e4m3_gluon row times the other choice (prefetch_ms)
DEFAULT_PREFETCH = False


def _view(frag: FP8FragmentPages, pages: torch.Tensor) -> FP8FragmentPages:
    return FP8FragmentPages(frag.k_slabs[pages], frag.v_slabs[pages], frag.fmt, frag.version)


def fp8_decode_split_reference(q: torch.Tensor, frag: FP8FragmentPages, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, num_splits: int,
                               staged: Staged | None = None,
                               sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (o normalised, lse in base 2), split by split, in q's dtype; with
    `staged`, split num_splits holds the 16-bit tail."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits, "fp8_e4m3")
    check_extras(staged, sliding_window, B, Hkv)
    dt = q.dtype

    def page_scores(qg, pages):  # [n, H, G, 64]
        return torch.einsum("hgd,nhtd->nhgt", qg, dequantize_fragment(_view(frag, pages), "key").to(dt))

    def page_values(p, pages):  # [H, G, D]
        return torch.einsum("nhgt,nhtd->hgd", p, dequantize_fragment(_view(frag, pages), "value").to(dt))

    return split_reference(q, Hkv, block_tables, context_lens, scale, num_splits, staged, sliding_window,
                           page_scores, page_values)


# -- the GPU path ------------------------------------------------------------------------------------
def fp8_pool_args(what: str, fmt, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], dict]:
    """What a kernel reading FP8 pages (fp8_kernel.fp8_page: this module's kernel, tiered's) takes of pools k, v
    [N, H, slab] uint8 of fmt's slabs: their int32 and fp16 views (kf_w, vf_w, kf_h, vf_h) and the
    constexprs FW (int32 words a slab), F_KS, F_VS (the row scales' byte offsets); ValueError naming
    `what` unless the pools are contiguous uint8 with slabs of whole words."""
    if k.dtype != torch.uint8 or k.shape[2] % 4 or not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError(f"{what}: FP8 pools must be contiguous uint8 with slabs of whole words")
    views = (k.view(torch.int32), v.view(torch.int32), k.view(torch.float16), v.view(torch.float16))
    return views, {"FW": k.shape[2] // 4, "F_KS": scale_offset(fmt, "key"), "F_VS": scale_offset(fmt, "value")}


def fp8_decode_partials(q: torch.Tensor, frag: FP8FragmentPages, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                        max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                        sliding_window: int | None = None,
                        prefetch: bool = DEFAULT_PREFETCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (part_o, part_lse), fp32 (CUDA only); with `staged`, split
    num_splits holds the 16-bit tail. max_registers: ptxas's cap (None: its choice)."""
    B, Hkv, G = check_launch("fp8_e4m3", q, frag, block_tables, context_lens, num_splits, staged, sliding_window)
    pools, pool_constants = fp8_pool_args("fp8_e4m3 Gluon decode", frag.fmt, frag.k_slabs, frag.v_slabs)
    try:
        from moekv.ops.gluon.fp8_kernel import fp8_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("fp8_e4m3", e) from e
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers)
    fp8_decode_kernel[run.grid](
        *pools, q.contiguous(), block_tables, block_tables.stride(0), context_lens, run.seq_slots,
        run.k_stage, run.v_stage, *run.stage_strides,
        run.part_o, run.part_lse, scale * LOG2E, run.window, run.num_splits, run.ns_total,
        HKV=Hkv, G=G, STAGED=staged is not None, FP8_PREFETCH=bool(prefetch), num_warps=1, **pool_constants,
        **register_cap(max_registers))
    return run.part_o, run.part_lse


def fp8_decode_attention(q: torch.Tensor, frag: FP8FragmentPages, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                         max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                         sliding_window: int | None = None, out: torch.Tensor | None = None,
                         prefetch: bool = DEFAULT_PREFETCH, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over fp8_e4m3 pages in fragment order (and, with `staged`, the
    16-bit tail) -> [B, Hq, 128] in q's dtype: the Gluon kernel and the reduce, two launches, no host
    sync. CUDA only. sinks [Hq]: each head's sink logit, joining the reduce."""
    part_o, part_lse = fp8_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers,
                                           staged, sliding_window, prefetch)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q) if out is None else out, sinks)
