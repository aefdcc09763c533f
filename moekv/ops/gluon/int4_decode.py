"""Split-K paged decode attention over int4 pages in fragment order, with a Gluon kernel.

int4 stores k = code * scale[t, g] + zero[t, g] per token t and group g of 32 channels (values the
same), with a few outlier channels per page-head whose code is 0 and whose value is kept apart. Per
64-token page the Gluon kernel (int4_kernel.py) computes, exactly as this module's reference does:

  scores   S^T [64, 8] = sum_g scale[:, g] * (codes_g [64, 32] @ q_g^T [32, 8])     (per-group MMAs)
                       + sum_g zero[:, g] * qsum_g                                   (qsum_g[n] = sum_{c in g} q[n, c])
                       + sum_o delta_k[:, o] * q[:, c_o]                              (outlier channels)
  values   O^T_g [32, 8] += codes_g^T [32, 64] @ (scale[:, g] * P^T)                (per-token scale into P)
           Z [4, 8]      += zero^T [4, 64] @ P^T     (added to every channel of group g at the end)
           O^T[c_o]      += delta_v[:, o] . P^T      (per page: the channel changes from page to page)

with delta = outlier value - zero[t, group of c_o] (int4_layout.outlier_deltas). Codes reach the MMA
as exact small integers in fp16 (the magic-number conversion); the scales and zeros stay outside the
operands, in fp32 on the accumulators (keys) or in P's fp16 rounding (values' scale). Online softmax
in base 2; each split writes its partial (o, lse) as moekv/ops/decode/paged.py's reduce reads them.

`int4_decode_split_reference` is the oracle (plain PyTorch, float64 in tests, this algebra);
`int4_decode_attention` runs the Gluon kernel and the reduce on an NVIDIA GPU (sm_80+).
Shapes: q [B, Hq, 128]; block_tables [B, max_pages] int32; context_lens [B]; G = Hq / Hkv in
{1, 2, 4, 8}; staged = (k_stage, v_stage, seq_slots): the engine's newest page in 16 bits, one more
split of the same launch (nuq2's staged tile); sliding windows skip pages and mask the first.
"""
from __future__ import annotations

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.checks import Staged, check_extras, check_inputs
from moekv.ops.gluon.int4_layout import GROUP, GROUPS, HEAD_DIM, PAGE_TOKENS, Int4FragmentPages, codes_from_fragment
from moekv.ops.gluon.launch import check_launch, gluon_missing, plan_launch, reduce_on_device, register_cap
from moekv.ops.gluon.splits import split_reference


def _page_scores(qg: torch.Tensor, frag: Int4FragmentPages, pages: torch.Tensor) -> torch.Tensor:
    """qg [H, G, D] -> scores [n, H, G, 64] by the kernel's algebra, in qg's dtype."""
    dt = qg.dtype
    codes = codes_from_fragment(frag.k_codes[pages], "key").to(dt)  # [n, H, P, D]
    n, H = codes.shape[:2]
    codes = codes.reshape(n, H, PAGE_TOKENS, GROUPS, GROUP)
    q4 = qg.reshape(H, -1, GROUPS, GROUP)
    partial = torch.einsum("nhtgc,hkgc->nhkgt", codes, q4)  # [n, H, G, groups, P]
    scale = frag.k_scale[pages].to(dt).permute(0, 1, 3, 2)[:, :, None]  # [n, H, 1, groups, P]
    zero = frag.k_zero[pages].to(dt).permute(0, 1, 3, 2)[:, :, None]
    qsum = q4.sum(-1)[None, ..., None]  # [1, H, G, groups, 1]
    s = (scale * partial + zero * qsum).sum(3)  # [n, H, G, P]
    idx = frag.k_out_idx[pages].long()  # [n, H, O]
    G, O = qg.shape[1], idx.shape[2]
    q_at = qg[None].expand(n, H, G, HEAD_DIM).gather(3, idx[:, :, None, :].expand(n, H, G, O))  # q[n, c_o]
    return s + torch.einsum("nhto,nhgo->nhgt", frag.k_out_delta[pages].to(dt), q_at)


def _page_values(p: torch.Tensor, frag: Int4FragmentPages, pages: torch.Tensor) -> torch.Tensor:
    """p [n, H, G, 64] (softmax numerators) -> sum over the pages of P @ V by the kernel's algebra:
    [H, G, D]."""
    dt = p.dtype
    codes = codes_from_fragment(frag.v_codes[pages], "value").to(dt)  # [n, H, P, D]
    n, H = codes.shape[:2]
    codes = codes.reshape(n, H, PAGE_TOKENS, GROUPS, GROUP)
    scale = frag.v_scale[pages].to(dt)  # [n, H, P, groups]
    zero = frag.v_zero[pages].to(dt)
    p_g = p[..., None] * scale[:, :, None]  # [n, H, G, P, groups]: per-token scale into P
    o = torch.einsum("nhtgc,nhktg->hkgc", codes, p_g).reshape(H, -1, HEAD_DIM)
    z = torch.einsum("nhtg,nhkt->hkg", zero, p)  # [H, G, groups], added to each channel of the group
    o = o + z.repeat_interleave(GROUP, dim=-1)
    x = torch.einsum("nhto,nhkt->nhko", frag.v_out_delta[pages].to(dt), p)  # [n, H, G, O] per page
    idx = frag.v_out_idx[pages].long()  # [n, H, O]
    for h in range(H):
        o[h].index_add_(1, idx[:, h].reshape(-1), x[:, h].permute(1, 0, 2).reshape(o.shape[1], -1))
    return o


def int4_decode_split_reference(q: torch.Tensor, frag: Int4FragmentPages, block_tables: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, num_splits: int,
                                staged: Staged | None = None,
                                sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (o normalised, lse in base 2), split by split, in q's dtype; with
    `staged`, split num_splits holds the 16-bit tail."""
    B, Hkv, G = check_inputs(q, frag, block_tables, context_lens, num_splits, "int4")
    check_extras(staged, sliding_window, B, Hkv)
    return split_reference(q, Hkv, block_tables, context_lens, scale, num_splits, staged, sliding_window,
                           lambda qg, pages: _page_scores(qg, frag, pages),
                           lambda p, pages: _page_values(p, frag, pages))


# -- the GPU path ------------------------------------------------------------------------------------
# the kernel's PREFETCH (prefetch.py): into L1 (docs/decisions.md, "Prefetch and whole waves for the Gluon launches")
DEFAULT_PREFETCH = 1
# the kernel's SMEM: the next page's codes, key scales and zeros and value scales through shared memory
# (cp.async, two stages) instead of global loads at the page's top (docs/decisions.md, "Pages through
# shared memory where the launch fills the GPU")
DEFAULT_SMEM = True


def int4_decode_partials(q: torch.Tensor, frag: Int4FragmentPages, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                         max_registers: int | None = None, staged: Staged | None = None,
                         sliding_window: int | None = None, prefetch: int = DEFAULT_PREFETCH,
                         smem: bool = DEFAULT_SMEM) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (part_o, part_lse), fp32 (CUDA only); with `staged`, split
    num_splits holds the 16-bit tail. max_registers: ptxas's cap (None: its choice)."""
    B, Hkv, G = check_launch("int4", q, frag, block_tables, context_lens, num_splits, staged, sliding_window)
    try:
        from moekv.ops.gluon.int4_kernel import int4_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("int4", e) from e
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers)
    int4_decode_kernel[run.grid](
        frag.k_codes, frag.v_codes, frag.k_scale, frag.k_zero, frag.v_scale, frag.v_zero,
        frag.k_out_idx, frag.k_out_delta, frag.v_out_idx, frag.v_out_delta,
        q.contiguous(), block_tables, block_tables.stride(0), context_lens, run.seq_slots,
        run.k_stage, run.v_stage, *run.stage_strides,
        run.part_o, run.part_lse, scale * LOG2E, run.window, run.num_splits, run.ns_total,
        HKV=Hkv, G=G, NO=frag.num_outliers, STAGED=staged is not None, PREFETCH=prefetch, SMEM=smem,
        num_warps=1,
        **register_cap(max_registers))
    return run.part_o, run.part_lse


def int4_decode_attention(q: torch.Tensor, frag: Int4FragmentPages, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                          max_registers: int | None = None, staged: Staged | None = None,
                          sliding_window: int | None = None, out: torch.Tensor | None = None,
                          prefetch: int = DEFAULT_PREFETCH, smem: bool = DEFAULT_SMEM,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over int4 pages in fragment order (and, with `staged`, the
    16-bit tail) -> [B, Hq, 128] in q's dtype: the Gluon kernel and the reduce, two launches, no host
    sync. CUDA only. sinks [Hq]: each head's sink logit, joining the reduce."""
    part_o, part_lse = int4_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers,
                                            staged, sliding_window, prefetch, smem)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q) if out is None else out, sinks)
