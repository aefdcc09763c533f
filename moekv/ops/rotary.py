"""RoPE (rotate-half layout) for q and k in one launch, cos/sin computed in the kernel.

The reference (`rotary_cos_sin_ref` + `apply_rotary_ref` for q and k) is about twenty small
kernels; at batch 1 a decode step runs it in every layer. This kernel computes the angle of each
(token, frequency) in fp32 and rotates in fp32, where the reference rounds cos/sin and each
product to the model dtype: results agree to the model dtype's rounding, not bit for bit.
Shape legend: T = tokens, Hq / Hkv = query / KV heads, D = head_dim (even), D2 = D / 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rope_cos_sin(pos, i, D: tl.constexpr, log2_theta):
    """cos and sin of the angles pos * theta^(-2i/D) of frequencies i (fp32; pos a fp32 scalar)."""
    angle = pos * tl.exp2(-(2.0 * i.to(tl.float32) / D) * log2_theta)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rope_rotate(base, i, mask, c, s, D2: tl.constexpr):
    """The head at `base` (rotate-half layout) rotated: (x1 c - x2 s, x2 c + x1 s) for its halves x1,
    x2 at elements i (where mask), computed in fp32 and rounded to the head's dtype."""
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + D2 + i, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, stride_xt, stride_xh, stride_ot, stride_oh, log2_theta,
                   D: tl.constexpr, D2: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < D2
    c, s = rope_cos_sin(tl.load(pos_ptr + t).to(tl.float32), i, D, log2_theta)
    r1, r2 = rope_rotate(x_ptr + t * stride_xt + h * stride_xh, i, mask, c, s, D2)
    obase = out_ptr + t * stride_ot + h * stride_oh
    tl.store(obase + i, r1, mask=mask)
    tl.store(obase + D2 + i, r2, mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        import math

        _rotary_kernel[(T, H)](x, out, positions, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                               math.log2(theta), D, D // 2, triton.next_power_of_2(D // 2), num_warps=1)
    return out


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, theta: float):
    """positions [T], q [T, Hq, D], k [T, Hkv, D] (any row strides) -> rotated (q, k), contiguous."""
    D = q.shape[-1]
    if D % 2 or k.shape[-1] != D:
        raise ValueError(f"apply_rotary: head_dim must be even and equal for q and k, got {D} and {k.shape[-1]}")
    return _rotate(q, positions, theta), _rotate(k, positions, theta)
