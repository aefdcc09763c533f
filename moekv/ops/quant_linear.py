"""Projections with a weight-only quantized weight: out [T, N] = x [T, K] @ dequant(w) [N, K].T (+ bias).

A few tokens (decode, T <= GEMV_MAX_TOKENS) take one GEMV launch: program (token, n-block) streams
the codes of a [BLOCK_N, K] slab, dequantizes each tile in registers (ops/quant_tiles.py) and
reduces products to row sums every K step; tokens vary fastest in the grid, so programs sharing a
slab run together and all but the first read it from L2. More tokens take the dequantizing GEMM
(ops/fused_moe_quant.quant_gemm). The bias is added in fp32 before the one rounding to x's dtype.

Reference: `moekv.ops.reference.linear_ref` (the dequantized weight in x's dtype, F.linear); the
CPU path runs it. Shape legend: T = tokens, N = output features, K = input features.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.fused_moe_quant import QuantGemvShape, layout_constants, quant_gemm, weight_args
from moekv.ops.quant_tiles import quant_row_dots, scale_mode, use_f16_dots
from moekv.ops.quantized_weight import QuantizedWeight
from moekv.ops.reference import linear_ref

GEMV_MAX_TOKENS = 16  # beyond, the GEMM (each slab re-read from L2 per token costs more than tensor cores)


DEFAULT_SHAPE = QuantGemvShape()
# per method, the tile that read fastest at one token on an H200 at Mixtral-8x7B's qkv projection (6144 x 4096;
# benchmarks/kernels/bench_moe_quant.py --proj-tiles): int4 16 rows (0.39 of the floor against 0.30 at 4),
# fp8 8 rows (0.83 against 0.70); 4 rows for the rest
SHAPE_OF_METHOD = {"int4": QuantGemvShape(block_n=16), "fp8": QuantGemvShape(block_n=8)}


@triton.jit
def _quant_gemv_kernel(x_ptr, c_ptr, s_ptr, z_ptr, b_ptr, out_ptr, num_tokens, stride_xt, stride_cn, stride_sn,
                       stride_ot, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       INT4: tl.constexpr, MXFP4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr,
                       SK: tl.constexpr, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       F16_DOTS: tl.constexpr = False):
    """Program (token, n-block): out[token, n-block] (F16_DOTS: int4's dots in packed halves,
    quant_tiles.int4_f16_dots)."""
    pid = tl.program_id(0)
    t = pid % num_tokens
    offs_n = (pid // num_tokens) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += quant_row_dots(c_ptr, s_ptr, z_ptr, rows, n_ok, k0, x_ptr + t * stride_xt, K, stride_cn, stride_sn, INT4,
                              MXFP4, HAS_ZEROS, SN, SK, SCALE_MODE, BLOCK_N, BLOCK_K, F16_DOTS)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if w.codes.dim() != 2:
        raise ValueError(f"a quantized projection takes one [N, K] matrix, got shape {tuple(w.shape)}")
    N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K or (bias is not None and tuple(bias.shape) != (N,)):
        raise ValueError(f"quantized linear: weight {tuple(w.shape)} / bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match x {tuple(x.shape)}")


def quant_gemv(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
               shape: QuantGemvShape | None = None) -> torch.Tensor:
    """x [T, K] @ dequant(w) [N, K].T (+ bias [N]) -> [T, N] in x's dtype, fp32 accumulation."""
    _check(x, w, bias)
    T, K = x.shape
    N = w.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    s = shape or SHAPE_OF_METHOD.get(w.method, DEFAULT_SHAPE)
    block_k = min(s.block_k, max(8, triton.next_power_of_2(K)))
    c, sc, z, _, scn, _, ssn = weight_args(w)
    _quant_gemv_kernel[(T * triton.cdiv(N, s.block_n),)](
        x, c, sc, z, sc if bias is None else bias, out, T, x.stride(0), scn, ssn, out.stride(0), N, K,
        bias is not None, **layout_constants(w), SCALE_MODE=scale_mode(w.scale_block[1], K, block_k),
        BLOCK_N=s.block_n, BLOCK_K=block_k,
        F16_DOTS=use_f16_dots(s.f16_dots, w.method, x.device.type, w.scale_block[1], K, block_k),
        num_warps=s.num_warps, num_stages=s.num_stages)
    return out


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a quantized weight: the GEMV at a few tokens and the dequantizing GEMM beyond on
    CUDA; the reference elsewhere."""
    if not x.is_cuda:
        return linear_ref(x, w, bias)
    _check(x, w, bias)
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return quant_gemv(x, w, bias)
    if x.shape[0] == 0:
        return torch.empty(0, w.shape[0], dtype=x.dtype, device=x.device)
    y = quant_gemm(x, w)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
