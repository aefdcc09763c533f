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
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_TILE: tl.constexpr = False):
    """Rows `rows` (int64 [BLOCK_N], valid where n_ok) and columns k0 .. k0 + BLOCK_K of one matrix
    (codes_ptr / scales_ptr / zeros_ptr at its first element; the last dims contiguous, rows
    stride_cn and stride_sn apart; zeros shaped as the scales) -> fp32 [BLOCK_N, BLOCK_K]; 0 past K
    and on masked rows. INT4: codes hold 8 features per int32, lowest nibble first; BLOCK_K % 8 == 0.
    PER_TILE (scale_mode SCALES_PER_TILE: the tile lies in one group): one scale and zero point per
    row, not one load per element."""
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
    if PER_TILE:
        block = (rows // SN) * stride_sn + k0 // SK  # [BLOCK_N]: the scale index of each row
        s = tl.load(scales_ptr + block, mask=n_ok, other=0.0).to(tl.float32)
        if INT4:
            if HAS_ZEROS:
                q = q - tl.load(zeros_ptr + block, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            else:
                q = q - 8.0
        return q * s[:, None]
    else:
        block = (rows // SN)[:, None] * stride_sn + (offs_k // SK)[None, :]  # scale index of each element
        s = tl.load(scales_ptr + block, mask=mask, other=0.0).to(tl.float32)
        if INT4:
            if HAS_ZEROS:
                q = q - tl.load(zeros_ptr + block, mask=mask, other=0.0).to(tl.float32)
            else:
                q = q - 8.0
        return q * s


# how quant_row_dots finds a tile's scales (scale_mode): per element (any layout), one group spans the
# whole tile (SK a multiple of BLOCK_K, or one group over all of K), whole groups inside the tile
SCALES_PER_ELEMENT, SCALES_PER_TILE, SCALES_PER_GROUP = 0, 1, 2


def scale_mode(scale_k: int, K: int, block_k: int) -> int:
    """The cheapest way quant_row_dots can read the scales of a layout with SK = scale_k."""
    if scale_k % block_k == 0 or scale_k >= K:
        return SCALES_PER_TILE
    if block_k % scale_k == 0:
        return SCALES_PER_GROUP
    return SCALES_PER_ELEMENT


@triton.jit
def quant_row_dots(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, xv, K: tl.constexpr, stride_cn, stride_sn,
                   INT4: tl.constexpr, HAS_ZEROS: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                   SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k dequant(w)[row, k] * xv[k] over the tile's columns k0 .. k0 + BLOCK_K -> fp32 [BLOCK_N]
    (xv: fp32 [BLOCK_K], 0 past K). Same contract as dequant_tile, but the scales (and zero points)
    are read once per row and group and applied to the group's partial sums:
    sum (q - z) * s * x = s * (sum q * x - z * sum x)."""
    if SCALE_MODE == 0:
        w = dequant_tile(codes_ptr, scales_ptr, zeros_ptr, rows, n_ok, k0, K, stride_cn, stride_sn, INT4, HAS_ZEROS,
                         SN, SK, BLOCK_N, BLOCK_K)
        return tl.sum(w * xv[None, :], axis=1)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if INT4:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(codes_ptr + rows[:, None] * stride_cn + offs_w[None, :],
                        mask=n_ok[:, None] & (offs_w < K // 8)[None, :], other=0)
        nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        q = tl.reshape(nibbles, (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        q = tl.load(codes_ptr + rows[:, None] * stride_cn + offs_k[None, :],
                    mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    scale_rows = (rows // SN) * stride_sn
    if SCALE_MODE == 1:
        group = k0 // SK
        s = tl.load(scales_ptr + scale_rows + group, mask=n_ok, other=0.0).to(tl.float32)
        dots = tl.sum(q * xv[None, :], axis=1)
        if INT4:
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + scale_rows + group, mask=n_ok, other=0.0).to(tl.float32)
            else:
                z = 8.0
            dots = dots - z * tl.sum(xv, axis=0)
        return s * dots
    else:
        GROUPS: tl.constexpr = BLOCK_K // SK
        groups = k0 // SK + tl.arange(0, GROUPS)
        g_mask = n_ok[:, None] & (groups < (K + SK - 1) // SK)[None, :]
        s = tl.load(scales_ptr + scale_rows[:, None] + groups[None, :], mask=g_mask, other=0.0).to(tl.float32)
        dots = tl.sum(tl.reshape(q * xv[None, :], (BLOCK_N, GROUPS, SK)), axis=2)  # [BLOCK_N, GROUPS]
        if INT4:
            x_sums = tl.sum(tl.reshape(xv, (GROUPS, SK)), axis=1)  # [GROUPS]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + scale_rows[:, None] + groups[None, :], mask=g_mask, other=0.0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N, GROUPS), 8.0, tl.float32)
            dots = dots - z * x_sums[None, :]
        return tl.sum(dots * s, axis=1)
