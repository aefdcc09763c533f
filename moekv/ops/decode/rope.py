"""RoPE on a key tile in registers, for formats whose pages hold keys before RoPE (keys_before_rope).

The paged decode kernel (paged.py, DecodeSpec.key_rope) calls `rope_key_tile` on each dequantized
key tile before its product with q: the tile's row n is the key at position pos[n], rotated as the
attention layer rotates keys (rotate-half pairs (i, i + D/2) at angle pos * theta^(-2i/D), the
angle computed and the rotation done in fp32, as ops/rotary.py does for q and k).

The tile's columns are in the key reader's order (TileReader.planes PL: column PL*j + s holds
channel s*D/PL + j). A rotary pair (i, i + D/2) is then columns (PL*j + l, PL*j + PL/2 + l) with
i = l*D/PL + j, l < PL/2: both halves of a pair sit in the same group of PL columns, so the tile is
reshaped to [BLOCK_N, D/PL, 2, PL/2], its pair axis split into the two halves, rotated, and joined
back; with PL = 1 the halves are the first and second D/2 columns.

Cost per tile: BLOCK_N * D/2 angles (one exp2 per frequency, hoisted by the compiler out of the
token axis; one multiply per element), a cos and a sin each, and 6 FMAs per pair; per page of P = 64
tokens and D = 128: 4096 sincos pairs per (page, KV head), against 8192 code lookups.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_halves(x1, x2, pos, freq):
    """(x1 c - x2 s, x2 c + x1 s), angle pos * freq: x1, x2 and freq broadcastable, pos along axis 0."""
    angle = pos * freq
    c = tl.cos(angle)
    s = tl.sin(angle)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def rope_key_tile(x, pos, log2_theta, D: tl.constexpr, BLOCK_N: tl.constexpr, PL: tl.constexpr):
    """x [BLOCK_N, D] keys (any float dtype, columns in PL-plane order) rotated by RoPE at their
    positions pos [BLOCK_N] (int): [BLOCK_N, D] fp32 in the same column order."""
    x = x.to(tl.float32)
    p = pos.to(tl.float32)
    if PL == 1:
        halves = tl.permute(tl.reshape(x, (BLOCK_N, 2, D // 2)), (0, 2, 1))  # [n, i, half]
        x1, x2 = tl.split(halves)  # [n, D/2]
        i = tl.arange(0, D // 2).to(tl.float32)
        freq = tl.exp2(-(2.0 * i / D) * log2_theta)
        r1, r2 = _rotate_halves(x1, x2, p[:, None], freq[None, :])
        out = tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_N, D))
    else:
        QP: tl.constexpr = D // PL
        HP: tl.constexpr = PL // 2
        halves = tl.permute(tl.reshape(x, (BLOCK_N, QP, 2, HP)), (0, 1, 3, 2))  # [n, j, l, half]
        x1, x2 = tl.split(halves)  # [n, D/PL, PL/2]
        i = (tl.arange(0, HP)[None, :] * QP + tl.arange(0, QP)[:, None]).to(tl.float32)  # [D/PL, PL/2]
        freq = tl.exp2(-(2.0 * i / D) * log2_theta)
        r1, r2 = _rotate_halves(x1, x2, p[:, None, None], freq[None, :, :])
        out = tl.reshape(tl.permute(tl.join(r1, r2), (0, 1, 3, 2)), (BLOCK_N, D))
    return out


@triton.jit
def add_slot_elements(x, colm, col, delta, used, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """x [BLOCK_N, D] fp32 plus each used slot's delta [n] at (tile row colm, tile column col): the
    one-hot of the rows [BLOCK_N, n] @ delta times the one-hot of the columns [n, D]. Outlier slots
    go into a key tile itself (not into the scores, as without RoPE), since the tile is rotated after."""
    rows = (tl.arange(0, BLOCK_N)[:, None] == colm[None, :]) & used[None, :]  # [BLOCK_N, n]
    cols = tl.where(tl.arange(0, D)[None, :] == col[:, None], delta[:, None], 0.0)  # [n, D]
    # fp32 operands: tf32 on the GPU (the one-hot exact, delta to 10 bits, as the fp16 the tile becomes)
    return x + tl.dot(tl.where(rows, 1.0, 0.0), cols)
