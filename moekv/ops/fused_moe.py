"""Fused MoE experts step: tokens sorted by expert, one grouped GEMM per projection.

Semantics are those of `moekv.ops.reference.fused_moe_ref`: for each token, sum over its k experts
of weight * down(silu(gate(x)) * up(x)), with w13 [E, 2I, H] stacking gate rows then up rows.

Two paths, both free of host syncs (capturable in a CUDA graph: every grid is sized from shapes):
- grouped GEMM (`tl.dot`) for T*k > GEMV_MAX_PAIRS: `moe_align_block_size` sorts the (token, slot)
  pairs by expert and pads each expert's run to BLOCK_M rows; program (m-block, n-block) reads the
  expert of its block once per tile. `_gate_up_gemm_kernel` fuses SiLU-and-multiply in its epilogue
  (it holds a gate and an up accumulator for the same columns); `_down_gemm_kernel` scales by the
  routing weight in its epilogue and writes one fp32 row per pair, summed over the k slots after.
- GEMV for decode (T*k <= GEMV_MAX_PAIRS): no sort; program (pair, n-block[, k-split]) streams a
  [BLOCK_N, H] slab of its pair's expert. The pair index varies fastest in the grid, so pairs that
  share an expert read the same tile at about the same time (L2 hits, not HBM reads). Products
  accumulate element-wise in a [BLOCK_N, BLOCK_K] fp32 tile reduced once at the end. The down
  projection (N = H is the short side) splits K across programs to keep every SM streaming.

Shape legend: T = tokens, k = experts per token, M = T*k pairs (pair p = token p // k, slot p % k),
E = experts, H = hidden, I = expert intermediate size, S = k-splits.

The weight shapes (N, K) and k are constexprs: one compile per model, loops with known trip counts
(and the interpreter, under NumPy 2.4, cannot loop to a bound passed as a runtime scalar).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from moekv.ops.dense_gemv import row_dots
from moekv.ops.pdl import (
    launch_options,
    let_dependents_launch,
    pdl_enabled,
    prefetch_cols,
    prefetch_lines,
    prefetch_rows_l2,
    wait_for_inputs,
)

GEMV_MAX_PAIRS = 16  # decode fast path up to this many (token, slot) pairs ...
# ... unless the experts' runs average this many pairs: then the grouped GEMM, which reads an expert's tile
# once for all of them, wins (H200, Mixtral-8x7B's experts at T=8: bf16 0.63 against the GEMV's 0.85 ms, fp8
# 0.39 against 0.61; at T=4, one pair an expert, the two tie; docs/decisions.md, "MoE paths by reuse")
GEMM_MIN_MEAN_RUN = 2.0


def mean_run(num_pairs: int, num_experts: int) -> float:
    """Pairs an expert takes on average if every expert holds some: T*k / min(E, T*k)."""
    return num_pairs / max(1, min(num_experts, num_pairs))


def default_path(num_pairs: int, num_experts: int) -> str:
    """fused_moe's path for path=None: the GEMV for a few pairs that share few experts, else the grouped GEMM."""
    if num_pairs > GEMV_MAX_PAIRS or mean_run(num_pairs, num_experts) >= GEMM_MIN_MEAN_RUN:
        return "gemm"
    return "gemv"


# -- alignment: pairs sorted by expert, padded per expert to BLOCK_M ------------------------------------
def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded length: at most min(E, M) experts are non-empty, each padded by
    fewer than block_m rows."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [T, k] -> (sorted_ids [P], block_expert_ids [P / block_m], num_tokens_post_padded [1]).

    sorted_ids lists pair indices (t * k + slot) grouped by expert in increasing expert order, each
    expert's run padded to a multiple of block_m with the sentinel M = T*k; within an expert, pairs
    keep their order. block_expert_ids[b] is the expert of block b, -1 past the padded length.
    P = max_padded_pairs(...) rounded up to block_m: a bound fixed by shapes, so no host sync."""
    flat = topk_ids.reshape(-1)
    M = flat.numel()
    device = flat.device
    num_blocks = triton.cdiv(max_padded_pairs(M, num_experts, block_m), block_m)
    flat = flat.to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without a sync  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E]
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    sorted_experts, order = torch.sort(flat, stable=True)  # [M]
    rank = torch.arange(M, device=device) - count_start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_ids = torch.full((num_blocks * block_m,), M, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1).to(torch.int32)
    return sorted_ids, block_expert_ids, padded_end[-1:].to(torch.int32)


ALIGN_MAX_PAIRS = 128  # moe_align_small's bound: one program holds [slots, pairs] comparison tiles


@triton.jit
def _align_small_kernel(ids_ptr, sorted_ids_ptr, block_expert_ptr, M, E,
                        MP: tl.constexpr, BLOCK_M: tl.constexpr, SLOTS: tl.constexpr, SP: tl.constexpr,
                        NB: tl.constexpr, BP: tl.constexpr):
    """moe_align_block_size's outputs in one program for M <= MP pairs, from [MP, MP] and [SP, MP] comparison
    tiles instead of a sort: pair i's slot is the padded start of its expert (the sum of the padded run
    lengths of the smaller experts present) plus its rank among its expert's pairs."""
    offs = tl.arange(0, MP)
    ok = offs < M
    e = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
    e = tl.where(ok, e, E)  # absent pairs: an expert past the last, never counted
    e_i = e[:, None]
    e_j = e[None, :]
    ok_j = ok[None, :]
    same = (e_i == e_j) & ok_j  # [MP, MP]: row i, column j
    count = tl.sum(same.to(tl.int32), axis=1)  # [MP]: pairs of i's expert
    rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)  # [MP]: i's rank in its run
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = (rank == 0) & ok  # one pair stands for each expert present
    before = first[None, :] & (e_j < e_i)  # [MP, MP]: j is the first pair of an expert smaller than i's
    start = tl.sum(tl.where(before, padded[None, :], 0), axis=1)  # [MP]
    dest = tl.where(ok, start + rank, -1)  # [MP]: i's slot in sorted_ids
    slots = tl.arange(0, SP)
    hit = dest[None, :] == slots[:, None]  # [SP, MP]
    found = tl.sum(hit.to(tl.int32), axis=1)
    pair = tl.sum(tl.where(hit, offs[None, :], 0), axis=1)
    tl.store(sorted_ids_ptr + slots, tl.where(found > 0, pair, M), mask=slots < SLOTS)
    blocks = tl.arange(0, BP)
    in_block = (dest[None, :] // BLOCK_M == blocks[:, None]) & ok[None, :]  # [BP, MP]
    expert = tl.max(tl.where(in_block, e[None, :], -1), axis=1)
    tl.store(block_expert_ptr + blocks, expert, mask=blocks < NB)


def moe_align_small(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align_block_size's (sorted_ids, block_expert_ids) for T*k <= ALIGN_MAX_PAIRS pairs in one
    launch (the torch version takes about a dozen small kernels); equal to it element for element."""
    flat = topk_ids.reshape(-1)
    M = flat.numel()
    if M > ALIGN_MAX_PAIRS:
        raise ValueError(f"moe_align_small takes at most {ALIGN_MAX_PAIRS} pairs, got {M}")
    num_blocks = triton.cdiv(max_padded_pairs(M, num_experts, block_m), block_m)
    slots = num_blocks * block_m
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=flat.device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    if M:
        _align_small_kernel[(1,)](flat, sorted_ids, block_expert_ids, M, num_experts,
                                  MP=max(16, triton.next_power_of_2(M)), BLOCK_M=block_m, SLOTS=slots,
                                  SP=triton.next_power_of_2(slots), NB=num_blocks,
                                  BP=max(2, triton.next_power_of_2(num_blocks)), num_warps=4)
    return sorted_ids, block_expert_ids


# -- grouped GEMM kernels -------------------------------------------------------------------------
@triton.jit
def _block_coords(num_m_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M consecutive m-blocks sweep the n-blocks together (weight tiles
    of one expert are reused from L2 across its m-blocks)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def dot_tiles(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:  # the interpreter's bf16 dot is wrong (DESIGN.md section 6)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:  # fp32 activations: no TF32 rounding
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def activate(gate, up, b13_ptr, row, offs_n, n_ok, N: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
             ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gate/up epilogue (fp32): silu(gate) * up, or with CLAMPED gpt-oss's clamped SwiGLU
    (ops/reference.clamped_swiglu_ref); HAS_BIAS: the expert's b13 (at element `row` of b13_ptr: gate
    at n, up at N + n) added first. gate, up: [..., BLOCK_N] along offs_n."""
    if HAS_BIAS:
        gate += tl.load(b13_ptr + row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b13_ptr + row + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if CLAMPED:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return (up + 1.0) * gate / (1.0 + tl.exp(-ALPHA * gate))
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _gate_up_gemm_kernel(x_ptr, w13_ptr, h_ptr, sorted_ids_ptr, block_expert_ptr,
                         num_pairs, num_m_blocks, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                         stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         b13_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False,
                         ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = 0.0):
    """h[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, N + n]) for the pairs of one block
    (with HAS_BIAS / CLAMPED: activate's epilogue). N = I, K = H."""
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BLOCK_M]
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    # [BLOCK_K, BLOCK_N]
    g_ptrs = w13_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = dot_tiles(a, g, acc_g, UPCAST, IEEE)
        acc_u = dot_tiles(a, u, acc_u, UPCAST, IEEE)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    h = activate(acc_g, acc_u, b13_ptr, expert * stride_be, offs_n[None, :], n_ok[None, :], N, HAS_BIAS, CLAMPED,
                 ALPHA, LIMIT)
    h_ptrs = h_ptr + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_gemm_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
                      num_pairs, num_m_blocks, N: tl.constexpr, K: tl.constexpr,
                      stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ym, stride_yn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                      b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False):
    """y[pair, n] = weight[pair] * (h[pair] . w2[e, n] (+ b2[e, n] with HAS_BIAS)) in fp32. N = H, K = I."""
    pid_m, pid_n = _block_coords(num_m_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    pair = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pair[:, None] * stride_hm + offs_k[None, :] * stride_hk
    b_ptrs = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot_tiles(a, b, acc, UPCAST, IEEE)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + pair[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc * w[:, None], mask=row_ok[:, None] & n_ok[None, :])


# -- GEMV kernels (decode) ----------------------------------------------------------------------
@triton.jit
def _gate_up_gemv_kernel(x_ptr, w13_ptr, h_ptr, expert_ids_ptr, num_pairs,
                         N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                         stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_hm, stride_hn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                         ROW_SUMS: tl.constexpr, b13_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False,
                         CLAMPED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = 0.0):
    """Program (pair, n-block): h[pair, n-block] from one [2 x BLOCK_N, H] slab of its expert
    (with HAS_BIAS / CLAMPED: activate's epilogue).
    With PDL its expert id comes from the kernel before: wait first, then let the down GEMV start.
    ROW_SUMS: reduce the products every step (see dense_gemv.row_dots)."""
    wait_for_inputs(PDL)
    let_dependents_launch(PDL)
    pid = tl.program_id(0)
    pair = pid % num_pairs
    pid_n = pid // num_pairs
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    token = (pair // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token * stride_xt + offs_k * stride_xk  # [BLOCK_K]
    # [BLOCK_N, BLOCK_K]
    g_ptrs = w13_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    u_ptrs = g_ptrs + N * stride_wn
    if ROW_SUMS:
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs).to(tl.float32)
            g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < K - k0
            xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ROW_SUMS:
            acc_g += tl.sum(g.to(tl.float32) * xv[None, :], axis=1)
            acc_u += tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
        else:
            acc_g += g.to(tl.float32) * xv[None, :]
            acc_u += u.to(tl.float32) * xv[None, :]
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if ROW_SUMS:
        gate = acc_g
        up = acc_u
    else:
        gate = tl.sum(acc_g, axis=1)
        up = tl.sum(acc_u, axis=1)
    h = activate(gate, up, b13_ptr, expert * stride_be, offs_n, n_ok, N, HAS_BIAS, CLAMPED, ALPHA, LIMIT)
    tl.store(h_ptr + pair * stride_hm + offs_n * stride_hn, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _weighted_row_dots(h_ptr, w2_ptr, weights_ptr, expert_ids_ptr, pair, offs_n, n_ok, k_start,
                       K: tl.constexpr, K_LEN: tl.constexpr, stride_hm, stride_hk, stride_we, stride_wn, stride_wk,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ROW_SUMS: tl.constexpr,
                       b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False):
    """weight[pair] * (rows offs_n of the pair's expert in w2) . h[pair] over columns
    k_start .. k_start + K_LEN of I (masked past K unless EVEN_K) -> [BLOCK_N] fp32 (row_dots);
    with HAS_BIAS the expert's b2 at offs_n is added by the share that starts at column 0."""
    expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + pair * stride_hm + offs_k * stride_hk
    b_ptrs = w2_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    y = row_dots(a_ptrs, b_ptrs, offs_k, n_ok, K, K_LEN, BLOCK_K * stride_hk, BLOCK_K * stride_wk, BLOCK_N, BLOCK_K,
                 EVEN_K, ROW_SUMS)
    if HAS_BIAS:
        if k_start == 0:
            y += tl.load(b2_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return y * tl.load(weights_ptr + pair).to(tl.float32)


@triton.jit
def _down_gemv_kernel(h_ptr, w2_ptr, y_ptr, weights_ptr, expert_ids_ptr, num_pairs,
                      N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                      stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      PDL: tl.constexpr, PREFETCH_COLS: tl.constexpr, PREFETCH_LINES: tl.constexpr,
                      ROW_SUMS: tl.constexpr, b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False):
    """Program (pair, n-block, split): y[split, pair, n-block] = weight * partial dot over its
    K_PER_SPLIT (a multiple of BLOCK_K) columns of I (the last split may run past K: masked).
    With PDL the expert ids are read before waiting (written two launches back, ops/pdl.py), to
    prefetch the slab while the gate/up GEMV finishes."""
    pid = tl.program_id(0)
    pair = pid % num_pairs
    rest = pid // num_pairs
    num_n = tl.cdiv(N, BLOCK_N)
    pid_n = rest % num_n
    split = rest // num_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PDL and PREFETCH_LINES > 0:
        expert = tl.load(expert_ids_ptr + pair).to(tl.int64)
        rows = w2_ptr + expert * stride_we + offs_n.to(tl.int64) * stride_wn + split * K_PER_SPLIT * stride_wk
        prefetch_rows_l2(rows, n_ok, tl.minimum(PREFETCH_COLS, K - split * K_PER_SPLIT), PREFETCH_LINES)
    wait_for_inputs(PDL)
    y = _weighted_row_dots(h_ptr, w2_ptr, weights_ptr, expert_ids_ptr, pair, offs_n, n_ok, split * K_PER_SPLIT,
                           K, K_PER_SPLIT, stride_hm, stride_hk, stride_we, stride_wn, stride_wk,
                           BLOCK_N, BLOCK_K, EVEN_K, ROW_SUMS, b2_ptr, stride_be, HAS_BIAS)
    tl.store(y_ptr + split * stride_ys + pair * stride_ym + offs_n * stride_yn, y, mask=n_ok)


@triton.jit
def _down_gemv_fold_kernel(h_ptr, w2_ptr, out_ptr, weights_ptr, expert_ids_ptr, num_tokens,
                           N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
                           stride_hm, stride_hk, stride_we, stride_wn, stride_wk, stride_ot, stride_on,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           b2_ptr=None, stride_be=0, HAS_BIAS: tl.constexpr = False):
    """Program (token, n-block): out[token, n-block] = sum over the token's k slots of weight * the
    slot expert's rows . h[pair], written once in the output dtype: no fp32 partials, no sum and
    no cast launch after it. Slower than the split version at T=1 (fewer loads in flight; docs/decisions.md,
    "The MoE decode GEMV reduces to row sums"): kept as an option (GemvConfig.fold_slots), off."""
    pid = tl.program_id(0)
    token = pid % num_tokens
    pid_n = pid // num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        y += _weighted_row_dots(h_ptr, w2_ptr, weights_ptr, expert_ids_ptr, token * TOP_K + slot, offs_n, n_ok, 0,
                                K, K, stride_hm, stride_hk, stride_we, stride_wn, stride_wk, BLOCK_N, BLOCK_K, EVEN_K,
                                False, b2_ptr, stride_be, HAS_BIAS)
    tl.store(out_ptr + token * stride_ot + offs_n * stride_on, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_partials_kernel(y_ptr, out_ptr, stride_ys, stride_yt, stride_yk, stride_ot, H: tl.constexpr,
                         SPLITS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t, h-block] = sum of token t's fp32 partial rows y[s, t, slot] over k-splits and slots,
    cast to the output dtype: one launch instead of a reduce and a cast."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + s * stride_ys + t * stride_yt + j * stride_yk + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_partials(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [S, T, k, H] fp32 (H contiguous) -> sum over S and k, [T, H] in dtype."""
    S, T, k, H = y.shape
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    if T:
        block_h = min(256, triton.next_power_of_2(H))
        _sum_partials_kernel[(T, triton.cdiv(H, block_h))](y, out, y.stride(0), y.stride(1), y.stride(2), out.stride(0),
                                                           H, S, k, block_h, num_warps=2)
    return out


# -- launch configuration -------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemvConfig:
    # defaults: the best measured on the H200 (bench_moe_row_sums.py, then the whole decode step)
    block_n: int = 8
    block_k: int = 1024
    num_splits: int | None = None  # of the down projection's K (= I); None: enough programs to fill the GPU
    # down projection: one program per (token, n-block) sums the token's k slots and writes the
    # output dtype (no split of K, no fp32 partials and no sum/cast launches); block_n then
    # sets the parallelism (H / block_n programs per token)
    fold_slots: bool = False
    num_warps: int = 4
    num_stages: int = 4
    # reduce products to row sums every K step instead of one fp32 [block_n, block_k] tile reduced
    # at the end (the tile held 247 registers a thread at 16 x 512): 8 x 1024 with row sums reads at the
    # copy floor (docs/decisions.md, "The MoE decode GEMV reduces to row sums")
    row_sums: bool = True


DEFAULT_GEMV = GemvConfig()


def default_gemm_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Untuned first guesses by rows per expert (see benchmarks/bench_moe.py for the sweep)."""
    rows = num_pairs / num_experts
    if rows <= 16:
        return GemmConfig(16, 64, 128, 1, 4, 4)
    if rows <= 64:
        return GemmConfig(32, 128, 64, 8, 4, 4)
    return GemmConfig(64, 128, 64, 8, 8, 3)


@lru_cache(maxsize=None)
def num_sms_of(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits(programs: int, k_blocks: int, num_sms: int) -> int:
    """Splits of the down GEMV's K so that about 4 programs per SM stream weights; a divisor of
    the K blocks where one is near, so that no split runs past I (unmasked loads)."""
    target = max(1, min(8, triton.cdiv(4 * num_sms, programs)))
    divisors = [s for s in range(target, min(8, k_blocks) + 1) if k_blocks % s == 0]
    return divisors[0] if divisors else target


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# -- public launcher ------------------------------------------------------------------------------
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, path: str | None = None,
              config: GemmConfig | GemvConfig | None = None,
              biases: tuple[torch.Tensor, torch.Tensor] | None = None,
              clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """Same contract as fused_moe_ref: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k];
    topk_ids [T, k] -> [T, H] in x.dtype. path: "gemv" | "gemm" | None (gemv when T*k <= GEMV_MAX_PAIRS);
    config: launch shape for that path (None: a default). gpt-oss's experts (clamped_swiglu_moe_ref's
    contract): biases (b13 [E, 2I], b2 [E, H]) added in the epilogues, clamped_swiglu (alpha, limit)
    in place of silu(gate) * up."""
    T, H = x.shape
    E, two_i, H_w = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    if H_w != H or two_i != 2 * I or tuple(w2.shape) != (E, H, I) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: shapes do not match: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)}, topk_weights {tuple(topk_weights.shape)}, "
                         f"topk_ids {tuple(topk_ids.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    epilogue = epilogue_args(w13, w2, biases, clamped_swiglu)
    M = T * k
    if M == 0:
        return torch.zeros_like(x)
    if path is None:
        path = default_path(M, E)
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)  # [M, I]
    if path == "gemv":
        cfg = config or DEFAULT_GEMV
        launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        pdl = pdl_enabled(x.device) and not cfg.fold_slots
        _gate_up_gemv_kernel[(M * triton.cdiv(I, cfg.block_n),)](
            x, w13, h, ids, M, I, H, k, *x.stride(), *w13.stride(), *h.stride(),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=H % cfg.block_k == 0, PDL=pdl, ROW_SUMS=cfg.row_sums,
            **epilogue["gate_up"], **launch, **launch_options(pdl))
        if cfg.fold_slots:
            out = torch.empty_like(x)
            _down_gemv_fold_kernel[(T * triton.cdiv(H, cfg.block_n),)](
                h, w2, out, weights, ids, T, H, I, k, *h.stride(), *w2.stride(), *out.stride(),
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=I % cfg.block_k == 0, **epilogue["down"], **launch)
            return out
        num_n = triton.cdiv(H, cfg.block_n)
        k_blocks = triton.cdiv(I, cfg.block_k)
        splits = min(cfg.num_splits or default_splits(M * num_n, k_blocks, num_sms_of(x.device)), k_blocks)
        k_per_split = triton.cdiv(k_blocks, splits) * cfg.block_k
        splits = triton.cdiv(I, k_per_split)
        y = torch.empty(splits, M, H, dtype=torch.float32, device=x.device)  # [S, M, H]
        cols = prefetch_cols(k_per_split, cfg.block_k)
        _down_gemv_kernel[(M * num_n * splits,)](
            h, w2, y, weights, ids, M, H, I, k_per_split, *h.stride(), *w2.stride(), *y.stride(),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=I % k_per_split == 0, PDL=pdl,
            PREFETCH_COLS=cols, PREFETCH_LINES=prefetch_lines(cols), ROW_SUMS=cfg.row_sums, **epilogue["down"],
            **launch, **launch_options(pdl))
        return sum_partials(y.view(splits, T, k, H), x.dtype)
    if path != "gemm":
        raise ValueError(f"fused_moe: path must be 'gemv', 'gemm' or None, got {path!r}")
    cfg = config or default_gemm_config(M, E)
    sorted_ids, block_expert_ids, _ = moe_align_block_size(topk_ids, E, cfg.block_m)
    num_m_blocks = block_expert_ids.numel()
    upcast = interpreting() and x.dtype == torch.bfloat16
    ieee = x.dtype == torch.float32
    launch = dict(GROUP_M=cfg.group_m, UPCAST=upcast, IEEE=ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gate_up_gemm_kernel[(num_m_blocks * triton.cdiv(I, cfg.block_n),)](
        x, w13, h, sorted_ids, block_expert_ids, M, num_m_blocks, I, H, k,
        *x.stride(), *w13.stride(), *h.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=H % cfg.block_k == 0,
        **epilogue["gate_up"], **launch)
    y = torch.empty(M, H, dtype=torch.float32, device=x.device)  # [M, H], one row per pair
    _down_gemm_kernel[(num_m_blocks * triton.cdiv(H, cfg.block_n),)](
        h, w2, y, weights, sorted_ids, block_expert_ids, M, num_m_blocks, H, I,
        *h.stride(), *w2.stride(), *y.stride(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=I % cfg.block_k == 0,
        **epilogue["down"], **launch)
    return sum_partials(y.view(1, T, k, H), x.dtype)


def epilogue_args(w13: torch.Tensor, w2: torch.Tensor, biases, clamped_swiglu) -> dict[str, dict]:
    """The gate/up and down kernels' epilogue keywords (none beyond their defaults for silu without biases)."""
    gate_up, down = {}, {}
    if biases is not None:
        b13, b2 = biases
        E, two_i, H = w13.shape
        if tuple(b13.shape) != (E, two_i) or tuple(b2.shape) != (E, H) or b13.stride(1) != 1 or b2.stride(1) != 1:
            raise ValueError(f"fused_moe: biases must be b13 [E, 2I] = {(E, two_i)} and b2 [E, H] = {(E, H)} with "
                             f"contiguous rows, got {tuple(b13.shape)} and {tuple(b2.shape)}")
        gate_up = dict(b13_ptr=b13, stride_be=b13.stride(0), HAS_BIAS=True)
        down = dict(b2_ptr=b2, stride_be=b2.stride(0), HAS_BIAS=True)
    if clamped_swiglu is not None:
        alpha, limit = clamped_swiglu
        gate_up.update(CLAMPED=True, ALPHA=float(alpha), LIMIT=float(limit))
    return {"gate_up": gate_up, "down": down}
