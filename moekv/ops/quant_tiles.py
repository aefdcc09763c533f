"""Triton helper shared by the quantized-weight kernels: one [BLOCK_N, BLOCK_K] tile of a
QuantizedWeight's matrix, dequantized to fp32 in registers (the layout: ops/quantized_weight.py).

Reference: `QuantizedWeight.dequantize` (fp32), tile by tile.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dequant_tile(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, K: tl.constexpr, stride_cn, stride_sn,
                 INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `rows` (int64 [BLOCK_N], valid where n_ok) and columns k0 .. k0 + BLOCK_K of one matrix
    (codes_ptr / scales_ptr / zeros_ptr at its first element; the last dims contiguous, rows
    stride_cn and stride_sn apart; zeros shaped as the scales) -> fp32 [BLOCK_N, BLOCK_K]; 0 past K
    and on masked rows. INT4: codes hold 8 features per int32, lowest nibble first; BLOCK_K % 8 == 0."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    mask = n_ok[:, None] & k_ok[None, :]
    if INT4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(codes_ptr + rows[:, None] * stride_cn + offs_w[None, :],
                        mask=n_ok[:, None] & (offs_w < K // 8)[None, :], other=0)  # [BLOCK_N, BLOCK_K / 8]
        nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        q = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        q = tl.load(codes_ptr + rows[:, None] * stride_cn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    block = (rows // SN)[:, None] * stride_sn + (offs_k // SK)[None, :]  # scale index of each element
    s = tl.load(scales_ptr + block, mask=mask, other=0.0).to(tl.float32)
    if INT4:
        if HAS_ZEROS:
            q = q - tl.load(zeros_ptr + block, mask=mask, other=0.0).to(tl.float32)
        else:
            q = q - 8.0
    return q * s
