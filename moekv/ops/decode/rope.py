"""RoPE in registers for key tile readers of pages that hold keys before RoPE (keys_before_rope).

With DecodeSpec.key_rope the paged decode kernel (paged.py) hands the key reader its tokens'
positions and log2(theta); the reader returns the tile rotated as the attention layer rotates keys:
rotate-half pairs (i, i + D/2) at angle pos * theta^(-2i/D), the angle computed and the rotation
done in fp32, as ops/rotary.py does for q and k. A reader rotates before its columns are put in the
kernel's order, on two tensors that hold the halves of the pairs element for element (nuq2: the
code planes s and s + 2 of a byte, which hold channels j + s*D/4 and j + (s+2)*D/4; vq: the
codebook rows of the first and of the second half of the channel groups), so the rotation moves no
data between threads; the column order it returns (TileReader.planes) puts each pair side by side.

Outlier slots sit at single elements before the rotation: a reader writes them into its halves
before it rotates (`add_slot_elements`, a one-hot product per 16 slots), since after the rotation
an element's correction would spread over its pair.

Cost per (page, KV head) of P = 64 tokens, D = 128: P * D/2 = 4096 angles (one multiply each; the
frequencies theta^(-2i/D) once per tile), each reduced to [-pi, pi] (3 FMAs) and given to the
hardware's sin and cos approximations (2 MUFU instructions), then 6 FMAs per pair; the keys' channel
affine, which the reader of post-RoPE keys folds into q once per page, is applied to every element.
"""
from __future__ import annotations

import triton
import triton.language as tl

# sin and cos of an angle reduced to [-pi, pi] by the hardware's approximations (MUFU): 2 instructions
_SINCOS_PTX = tl.constexpr("sin.approx.f32 $0, $2; cos.approx.f32 $1, $2;")
TWO_PI_HI = tl.constexpr(6.28125)  # 201 / 32: n * TWO_PI_HI is exact for |n| < 2^16 (angles to 4e5 rad)
TWO_PI_LO = tl.constexpr(0.0019353071795864769)  # 2 pi - TWO_PI_HI
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _sin_cos(angle, ASM: tl.constexpr):
    """sin and cos of fp32 angles. ASM (compiled for an NVIDIA GPU): the angle less the nearest
    multiple of 2 pi (in two parts, so the reduction adds ~1e-6 rad, far under the fp32 rounding of
    the angle itself: 0.008 rad at 1e5), then sin.approx / cos.approx (~1e-6 on [-pi, pi]); libdevice's
    sinf / cosf take 20-40 instructions each and a local-memory path beyond 1e5 rad. Else tl.sin /
    tl.cos (the interpreter's path)."""
    if ASM:
        n = tl.floor(angle * INV_TWO_PI + 0.5)
        r = (angle - n * TWO_PI_HI) - n * TWO_PI_LO
        s, c = tl.inline_asm_elementwise(_SINCOS_PTX, "=r,=r,r", [r], dtype=(tl.float32, tl.float32),
                                         is_pure=True, pack=1)
    else:
        s = tl.sin(angle)
        c = tl.cos(angle)
    return s, c


@triton.jit
def rope_pair(x1, x2, pos, i, log2_theta, D: tl.constexpr, ASM: tl.constexpr = False):
    """The rotary pairs (x1, x2) (fp32, any broadcastable shapes) at positions pos and frequency
    indices i (i < D/2) rotated: (x1 c - x2 s, x2 c + x1 s) at angle pos * theta^(-2i/D), the angle
    in fp32 as ops/rotary.py computes it."""
    angle = pos.to(tl.float32) * tl.exp2(-(2.0 * i.to(tl.float32) / D) * log2_theta)
    s, c = _sin_cos(angle, ASM)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def add_slot_elements(x, colm, col, delta, used, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """x [BLOCK_N, W] fp32 plus each used slot's delta [n] at (tile row colm, column col; a column
    outside [0, W) adds nothing): the one-hot of the rows [BLOCK_N, n] @ delta times the one-hot of
    the columns [n, W]."""
    rows = (tl.arange(0, BLOCK_N)[:, None] == colm[None, :]) & used[None, :]  # [BLOCK_N, n]
    if W < 16:  # narrower than an MMA: a sum over the slots
        hit = rows[:, :, None] & (tl.arange(0, W)[None, None, :] == col[None, :, None])  # [BLOCK_N, n, W]
        return x + tl.sum(tl.where(hit, delta[None, :, None], 0.0), axis=1)
    cols = tl.where(tl.arange(0, W)[None, :] == col[:, None], delta[:, None], 0.0)  # [n, W]
    # fp32 operands: tf32 on the GPU (the one-hot exact, delta to 10 bits, as the fp16 the tile becomes)
    return x + tl.dot(tl.where(rows, 1.0, 0.0), cols)
