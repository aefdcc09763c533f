"""Projections of a few tokens (decode) in one launch: out [T, N] = x [T, K] @ weight [N, K].T (+ bias).

At batch 1 the attention projections are pure weight streaming (the qkv and o weights of a
Mixtral-8x7B layer are 84 MB), and cuBLAS runs them below HBM bandwidth (its o projection also adds
a split-K reduce launch; docs/decisions.md, "Small kernels of a batch-1 step"). Used for one token
only (MAX_TOKENS). Here program (token, n-block) streams a [BLOCK_N, K] slab of the weight; tokens
vary fastest in the grid, so the programs that share a slab run together and all but the first read
it from L2. Products accumulate element-wise in a [BLOCK_N, BLOCK_K] fp32 tile reduced once at the
end, as the MoE decode GEMV does; the bias is added in fp32 before the one rounding to x's dtype.

Reference: `F.linear(x, weight, bias)`. Shape legend: T = tokens, N = output features, K = input features.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moekv.ops.pdl import launch_options, pdl_enabled, prefetch_cols, prefetch_lines, prefetch_rows_l2, wait_for_inputs

# at more tokens cuBLAS' tensor-core GEMM is faster (here each slab is re-read from L2 per token;
# docs/decisions.md, "Small kernels of a batch-1 step")
MAX_TOKENS = 1


@dataclass(frozen=True)
class GemvShape:
    """Launch shape. Default: 4 whole rows per program (for K <= 4096: one load each, no loop), the
    best of benchmarks/e2e/sweep_decode_b1.py (docs/decisions.md, "Small kernels of a batch-1 step"):
    with tiles looped over K a program waits a memory latency per step, so fewer, longer programs leave
    HBM idle."""
    block_n: int = 4
    block_k: int = 4096
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_SHAPE = GemvShape()


@triton.jit
def row_dots(a_ptrs, b_ptrs, offs_k, n_ok, k_limit, K_LEN: tl.constexpr, a_step, b_step,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ROW_SUMS: tl.constexpr = False):
    """The rows of b . a over K_LEN columns, BLOCK_K at a time: a_ptrs [BLOCK_K] and b_ptrs
    [BLOCK_N, BLOCK_K] advance by a_step / b_step; columns at offs_k >= k_limit - k0 read as 0 unless
    EVEN_K; rows with n_ok False too -> [BLOCK_N] fp32. Products accumulate element-wise in a
    [BLOCK_N, BLOCK_K] fp32 tile reduced once at the end (fewest instructions), or with ROW_SUMS
    are reduced to [BLOCK_N] every step (a fraction of the registers: more programs per SM, so more
    loads in flight). (Shared with the MoE down GEMV.)"""
    if ROW_SUMS:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K_LEN, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
            b = tl.load(b_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = offs_k < k_limit - k0
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            b = tl.load(b_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if ROW_SUMS:
            acc += tl.sum(b.to(tl.float32) * a[None, :], axis=1)
        else:
            acc += b.to(tl.float32) * a[None, :]
        a_ptrs += a_step
        b_ptrs += b_step
    if ROW_SUMS:
        return acc
    else:
        return tl.sum(acc, axis=1)


@triton.jit
def _dense_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, num_tokens, stride_xt, stride_wn, stride_ot,
                       N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       PDL: tl.constexpr, PREFETCH_COLS: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    pid = tl.program_id(0)
    t = pid % num_tokens
    offs_n = (pid // num_tokens) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + t * stride_xt + offs_k
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_wn
    if PDL and PREFETCH_LINES > 0:  # the weights do not depend on the kernel before: ask for the first tiles now
        prefetch_rows_l2(w_rows, n_ok, PREFETCH_COLS, PREFETCH_LINES)
    wait_for_inputs(PDL)
    y = row_dots(x_ptrs, w_rows[:, None] + offs_k[None, :], offs_k, n_ok, K, K, BLOCK_K, BLOCK_K, BLOCK_N, BLOCK_K,
                 EVEN_K)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether dense_gemv is the launch to use: a CUDA decode-size batch of 16-bit activations."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_TOKENS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               shape: GemvShape | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T (+ bias [N]) -> [T, N] in x's dtype, fp32 accumulation."""
    T, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or (bias is not None and tuple(bias.shape) != (N,)):
        raise ValueError(f"dense_gemv: weight {tuple(weight.shape)} / bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match x {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    s = shape or DEFAULT_SHAPE
    block_k = min(s.block_k, triton.next_power_of_2(K))
    pdl = pdl_enabled(x.device)
    cols = prefetch_cols(K, block_k)
    _dense_gemv_kernel[(T * triton.cdiv(N, s.block_n),)](
        x, weight, weight if bias is None else bias, out, T, x.stride(0), weight.stride(0), out.stride(0),
        N, K, bias is not None, s.block_n, block_k, K % block_k == 0, pdl, cols, prefetch_lines(cols),
        num_warps=s.num_warps, num_stages=s.num_stages, **launch_options(pdl))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through dense_gemv where that is the better launch (`fits`)."""
    if fits(x, weight):
        return dense_gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
