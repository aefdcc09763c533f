"""Split-K paged decode attention over kivi2 pages in fragment order, with a Gluon kernel.

kivi2 stores keys k[t, c] = code * ks[t // 32, c] + kz[t // 32, c] (per channel over groups of 32
tokens) and values v[t, c] = code * vs[t, c // 32] + vz[t, c // 32] (per token over groups of 32
channels), 2-bit codes, and keeps the newest R tokens in a 16-bit residual ring beside the pages
(moekv/kvcache/formats/kivi2.py). Per 64-token page, two token halves h = 0, 1 (one key group each),
the Gluon kernel (kivi2_kernel.py) computes, exactly as this module's reference does:

  scores   S^T_h [32, 8] = codes_h [32, 128] @ (ks[h] * q)^T [128, 8]      (the keys' scale folded into q)
                         + Z_h [32, 128] @ q^T [128, 8],  Z_h = kz[h] in every row   (the zeros: q . kz[h])
  values   O^T_g [32, 8] += codes_g^T [32, 64] @ (vs[:, g] * P^T) [64, 8]  (the values' scale into P)
           W [16, 8]     += vz^T [4 -> 16, 64] @ P^T   (row g added to every channel of group g at the end)

Codes reach the MMAs as exact small integers in fp16 (the magic-number trick); the products are
summed in fp32. The fp16 roundings are those of ks * q, of q itself and of P and vs * P
(`kernel_roundings=True` emulates them in float32). Online softmax in base 2; each split writes its
partial (o, lse) as moekv/ops/decode/paged.py's reduce reads them.

The 16-bit tail is read by one or more splits of the same launch (launch.plan_splits; with a ring,
several at batch 1, each a contiguous share of it): tokens [quantized, length) with
quantized = min(((len - 1) // 64) * 64, max(len - R, 0)) (the Triton kernel's rule): a token t >=
len - R from the residual ring (row t % R), an older one from the staging page (row t % 64). Pages
hold tokens [0, quantized); the page holding `quantized` is read up to it. Sliding windows skip the
pages before the window and mask inside the first one.

Shapes: q [B, Hq, 128]; block_tables [B, max_pages] int32; context_lens [B]; G = Hq / Hkv in {1, 2, 4,
8}; staged = (k_stage, v_stage, seq_slots) [S, Hkv, 64, 128] 16-bit and [B]; residual = (k_ring,
v_ring) [S, Hkv, R, 128] 16-bit at the same slots (needs staged).
"""
from __future__ import annotations

import math

import torch

from moekv.ops.decode.common import LOG2E
from moekv.ops.gluon.checks import Residual, Staged, check_extras, check_residual, check_tail_splits
from moekv.ops.gluon.checks import check_inputs as check_pages
from moekv.ops.gluon.kivi2_layout import (
    GROUP,
    HEAD_DIM,
    KEY_GROUPS,
    PAGE_TOKENS,
    VALUE_GROUPS,
    Kivi2FragmentPages,
    codes_from_fragment,
    key_side_by_channel,
)
from moekv.ops.gluon.launch import (
    check_device,
    gluon_missing,
    plan_launch,
    reduce_on_device,
    register_cap,
    ring_args,
)
from moekv.ops.gluon.splits import masked, quantized_tokens, split_ranges, tail_shares, tail_tokens, window_start

# ptxas's register cap: the staged kernel takes ~250 registers uncapped (8 one-warp programs an SM);
# 168 holds 12, with no spill inside the loops at G 1 / 4 / 8 (sm_90 builds)
DEFAULT_MAX_REGISTERS = 168
# the kernel's PREFETCH (prefetch.py): into L2 (docs/decisions.md, "Prefetch and whole waves for the Gluon launches")
DEFAULT_PREFETCH = 2
# the kernel's SIDE_SMEM: the side tables a page ahead through shared memory (cp.async)
DEFAULT_SIDE_SMEM = True
# CODES_SMEM: the codes too through shared memory, instead of the register double buffer. None: when
# the launch fills a wave of the GPU (Launch.fills_wave, a launch cut to one wave counted); small launches
# (batch 1 to 4 at 4k-16k) lose to it (docs/decisions.md, "Pages through shared memory where the launch
# fills the GPU")
DEFAULT_CODES_SMEM = None


def check_inputs(q: torch.Tensor, frag: Kivi2FragmentPages, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 num_splits: int, staged: Staged | None, residual: Residual | None,
                 sliding_window: int | None) -> tuple[int, int, int, int]:
    """(B, Hkv, G, R), or ValueError naming what does not fit."""
    B, Hkv, G = check_pages(q, frag, block_tables, context_lens, num_splits, "kivi2")
    check_extras(staged, sliding_window, B, Hkv)
    return B, Hkv, G, check_residual(residual, staged, Hkv, "kivi2", GROUP)


# -- the reference (what the kernel computes) ----------------------------------------------------------
def _f16(x: torch.Tensor, on: bool) -> torch.Tensor:
    """x rounded to fp16 and back (the kernel's operand roundings) when `on`."""
    return x.to(torch.float16).to(x.dtype) if on else x


def _page_scores(qg: torch.Tensor, frag: Kivi2FragmentPages, pages: torch.Tensor, rnd: bool) -> torch.Tensor:
    """qg [H, G, D] -> scores [n, H, G, 64] by the kernel's algebra, in qg's dtype (rnd: its fp16 roundings)."""
    dt = qg.dtype
    codes = codes_from_fragment(frag.k_codes[pages], "key").to(dt)  # [n, H, P, D]
    n, H = codes.shape[:2]
    halves = codes.reshape(n, H, KEY_GROUPS, GROUP, HEAD_DIM)
    q16 = _f16(qg, rnd)
    ks = key_side_by_channel(frag.k_scale[pages]).to(dt)  # [n, H, 2, D]
    kz = key_side_by_channel(frag.k_zero[pages]).to(dt)
    q_scaled = _f16(ks[:, :, :, None] * q16[None, :, None], rnd)  # [n, H, 2, G, D]: ks * q per half, fp16
    s = torch.einsum("nhitc,nhigc->nhgit", halves, q_scaled)  # [n, H, G, 2, 32]
    bias = torch.einsum("nhic,hgc->nhgi", kz, q16)  # [n, H, G, 2]: q . kz[h]
    return (s + bias[..., None]).reshape(n, H, -1, PAGE_TOKENS)


def _page_values(p: torch.Tensor, frag: Kivi2FragmentPages, pages: torch.Tensor, rnd: bool) -> torch.Tensor:
    """p [n, H, G, 64] (softmax numerators) -> sum over the pages of P @ V by the kernel's algebra: [H, G, D]."""
    dt = p.dtype
    codes = codes_from_fragment(frag.v_codes[pages], "value").to(dt)  # [n, H, P, D]
    n, H = codes.shape[:2]
    codes = codes.reshape(n, H, PAGE_TOKENS, VALUE_GROUPS, GROUP)
    vs = frag.v_scale[pages].to(dt)  # [n, H, P, groups]
    vz = frag.v_zero[pages].to(dt)
    p16 = _f16(p, rnd)
    p_g = _f16(p16[..., None] * vs[:, :, None], rnd)  # [n, H, G, P, groups]: per-token scale into P
    o = torch.einsum("nhtgc,nhktg->hkgc", codes, p_g).reshape(H, -1, HEAD_DIM)
    z = torch.einsum("nhtg,nhkt->hkg", vz, p16)  # [H, G, groups], added to each channel of the group
    return o + z.repeat_interleave(GROUP, dim=-1)


def kivi2_decode_split_reference(q: torch.Tensor, frag: Kivi2FragmentPages, block_tables: torch.Tensor,
                                 context_lens: torch.Tensor, scale: float, num_splits: int,
                                 staged: Staged | None = None, residual: Residual | None = None,
                                 sliding_window: int | None = None,
                                 kernel_roundings: bool = False, tail_splits: int = 1
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (o normalised, lse in base 2), split by split, in q's dtype; with
    `staged`, splits num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (and `residual`'s
    ring), each its share (tail_shares; more than one needs the ring). kernel_roundings: round the
    operands as the kernel does (fp16 q, ks * q, P, vs * P; the tail's q, K, V and P in bf16, the
    kernel's tail type for bf16 queries)."""
    B, Hkv, G, R = check_inputs(q, frag, block_tables, context_lens, num_splits, staged, residual, sliding_window)
    check_tail_splits(tail_splits, R)
    Hq, dt = q.shape[1], q.dtype
    ns_total = num_splits + (tail_splits if staged is not None else 0)
    part_o = torch.zeros(B, Hq, ns_total, HEAD_DIM, dtype=dt, device=q.device)
    part_lse = torch.full((B, Hq, ns_total), -math.inf, dtype=dt, device=q.device)
    qk2 = scale * LOG2E
    for b, length in enumerate(context_lens.tolist()):
        quantized = quantized_tokens(length, staged is not None, R)
        first = window_start(length, sliding_window)
        qb = q[b].reshape(Hkv, G, HEAD_DIM)
        for sp, p0, p1 in split_ranges(quantized, first, num_splits):  # no split when no page token is valid
            pages = block_tables[b, p0:p1].long()
            s = masked(_page_scores(qb, frag, pages, kernel_roundings) * qk2, p0, p1, quantized, first)  # [n, H, G, P]
            m = s.amax(dim=(0, 3), keepdim=True)  # [1, H, G, 1] (finite: every page holds a valid token)
            p = torch.exp2(s - m)
            mass = p.sum(dim=(0, 3))  # [H, G]
            o = _page_values(p, frag, pages, kernel_roundings) / mass[..., None]
            part_o[b, :, sp] = o.reshape(Hq, HEAD_DIM)
            part_lse[b, :, sp] = (m[0, :, :, 0] + torch.log2(mass)).reshape(Hq)
        if staged is None:
            continue
        for part, t0, t1 in tail_shares(max(quantized, first), length, tail_splits):
            k, v = tail_tokens(staged, residual, b, t0, length, dt, t1)  # [H, T, D]
            if kernel_roundings:  # the tail's MMAs run in q's 16-bit type
                k, v, qt = k.to(torch.bfloat16).to(dt), v.to(torch.bfloat16).to(dt), qb.to(torch.bfloat16).to(dt)
            else:
                qt = qb
            s = torch.einsum("hgd,htd->hgt", qt, k) * qk2
            m = s.amax(-1, keepdim=True)
            p = torch.exp2(s - m)
            mass = p.sum(-1)
            if kernel_roundings:
                p = p.to(torch.bfloat16).to(dt)
            sp = num_splits + part
            part_o[b, :, sp] = (torch.einsum("hgt,htd->hgd", p, v) / mass[..., None]).reshape(Hq, HEAD_DIM)
            part_lse[b, :, sp] = (m[..., 0] + torch.log2(mass)).reshape(Hq)
    return part_o, part_lse


# -- the GPU path ------------------------------------------------------------------------------------
def kivi2_decode_partials(q: torch.Tensor, frag: Kivi2FragmentPages, block_tables: torch.Tensor,
                          context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                          max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                          residual: Residual | None = None, sliding_window: int | None = None,
                          prefetch: int = DEFAULT_PREFETCH, side_smem: bool = DEFAULT_SIDE_SMEM,
                          codes_smem: bool | None = DEFAULT_CODES_SMEM, tail_splits: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon kernel's partials (part_o, part_lse), fp32 (CUDA only); with `staged`, splits
    num_splits .. num_splits + tail_splits - 1 hold the 16-bit tail (and the residual ring), each a share
    of it (tail_splits: None for launch.plan_splits' rule; more than 1 needs the ring). max_registers:
    ptxas's cap (None: its choice)."""
    B, Hkv, G, R = check_inputs(q, frag, block_tables, context_lens, num_splits or 1, staged, residual,
                                sliding_window)
    check_device("kivi2", q)
    try:
        from moekv.ops.gluon.kivi2_kernel import kivi2_decode_kernel
    except ImportError as e:  # Triton without Gluon
        raise gluon_missing("kivi2", e) from e
    run = plan_launch(q, B, Hkv, block_tables, context_lens, num_splits, staged, sliding_window, max_registers, R,
                      tail_splits)
    if codes_smem is None:
        codes_smem = run.fills_wave
    k_ring, v_ring, rt = ring_args(run, residual if R else None)
    kivi2_decode_kernel[run.grid](
        frag.k_codes, frag.v_codes, frag.k_scale, frag.k_zero, frag.v_scale, frag.v_zero,
        q.contiguous(), block_tables, block_tables.stride(0), context_lens, run.seq_slots,
        run.k_stage, run.v_stage, *run.stage_strides, k_ring, v_ring, rt[0], rt[1], rt[2], R,
        run.part_o, run.part_lse, scale * LOG2E, run.window, run.num_splits, run.ns_total,
        HKV=Hkv, G=G, STAGED=staged is not None, PREFETCH=prefetch, SIDE_SMEM=bool(side_smem),
        CODES_SMEM=bool(codes_smem), num_warps=1,
        **register_cap(max_registers))
    return run.part_o, run.part_lse


def kivi2_decode_attention(q: torch.Tensor, frag: Kivi2FragmentPages, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                           max_registers: int | None = DEFAULT_MAX_REGISTERS, staged: Staged | None = None,
                           residual: Residual | None = None, sliding_window: int | None = None,
                           out: torch.Tensor | None = None, prefetch: int = DEFAULT_PREFETCH,
                           side_smem: bool = DEFAULT_SIDE_SMEM,
                           codes_smem: bool | None = DEFAULT_CODES_SMEM,
                           sinks: torch.Tensor | None = None, tail_splits: int | None = None) -> torch.Tensor:
    """Decode attention of q [B, Hq, 128] over kivi2 pages in fragment order (and, with `staged`, the
    16-bit tail: staging page and residual ring, in tail_splits programs) -> [B, Hq, 128] in q's dtype: the
    Gluon kernel and the reduce, two launches, no host sync. CUDA only. sinks [Hq]: each head's sink logit,
    joining the reduce."""
    part_o, part_lse = kivi2_decode_partials(q, frag, block_tables, context_lens, scale, num_splits, max_registers,
                                             staged, residual, sliding_window, prefetch, side_smem, codes_smem,
                                             tail_splits)
    return reduce_on_device(part_o, part_lse, torch.empty_like(q) if out is None else out, sinks)
