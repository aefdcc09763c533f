"""RoPE (rotate-half layout) for q and k in one launch, cos/sin computed in the kernel.

The reference (`rotary_cos_sin_ref` + `apply_rotary_ref` for q and k) is about twenty small
kernels; at batch 1 a decode step runs it in every layer. This kernel computes the angle of each
(token, frequency) in fp32 and rotates in fp32, where the reference rounds cos/sin and each
product to the model dtype: results agree to the model dtype's rounding, not bit for bit.
Partial RoPE (GLM-4.5's partial_rotary_factor): only the first R of the D elements of a head are
rotated (rotate-half within those R, frequencies theta^(-2i/R)); elements R..D pass unchanged.
Scaled RoPE (gpt-oss's YaRN): a table of the R/2 inverse frequencies (fp32, layers/rotary.yarn_inv_freq)
replaces theta^(-2i/R), and cos and sin are multiplied by `scale` (YaRN's attention factor), as
`rotary_cos_sin_ref` with inv_freq and scale does; the angle pos * inv_freq[i] is the reference's fp32
product exactly.
Shape legend: T = tokens, Hq / Hkv = query / KV heads, D = head_dim, R = rotary dims (even, <= D),
R2 = R / 2.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def rope_cos_sin(pos, i, R: tl.constexpr, log2_theta):
    """cos and sin of the angles pos * theta^(-2i/R) of frequencies i (fp32; pos a fp32 scalar)."""
    angle = pos * tl.exp2(-(2.0 * i.to(tl.float32) / R) * log2_theta)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rope_cos_sin_of(pos, i, mask, R: tl.constexpr, log2_theta, inv_ptr, scale, HAS_TABLE: tl.constexpr):
    """cos and sin (fp32) of frequencies i at pos: from theta (rope_cos_sin), or with HAS_TABLE from the
    inverse frequencies at inv_ptr [R/2] (fp32), both multiplied by scale."""
    if HAS_TABLE:
        angle = pos * tl.load(inv_ptr + i, mask=mask, other=0.0)
        return tl.cos(angle) * scale, tl.sin(angle) * scale
    else:
        return rope_cos_sin(pos, i, R, log2_theta)


@triton.jit
def rope_rotate(base, i, mask, c, s, R2: tl.constexpr):
    """The rotated part of the head at `base` (rotate-half layout over its first 2 * R2 elements):
    (x1 c - x2 s, x2 c + x1 s) for its halves x1, x2 at elements i (where mask), computed in fp32 and
    rounded to the head's dtype."""
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + R2 + i, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)


@triton.jit
def rope_pass_mask(D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The elements j (and their mask) of a head that partial RoPE leaves unrotated: R <= j < D."""
    j = tl.arange(0, BLOCK_D)
    return j, (j >= R) & (j < D)


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, pos_ptr, inv_ptr, stride_xt, stride_xh, stride_ot, stride_oh, log2_theta, scale,
                   D: tl.constexpr, R: tl.constexpr, R2: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_D: tl.constexpr, HAS_TABLE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < R2
    c, s = rope_cos_sin_of(tl.load(pos_ptr + t).to(tl.float32), i, mask, R, log2_theta, inv_ptr, scale, HAS_TABLE)
    xbase = x_ptr + t * stride_xt + h * stride_xh
    r1, r2 = rope_rotate(xbase, i, mask, c, s, R2)
    obase = out_ptr + t * stride_ot + h * stride_oh
    tl.store(obase + i, r1, mask=mask)
    tl.store(obase + R2 + i, r2, mask=mask)
    if R < D:  # partial RoPE: the rest of the head is copied
        j, pmask = rope_pass_mask(D, R, BLOCK_D)
        tl.store(obase + j, tl.load(xbase + j, mask=pmask, other=0.0), mask=pmask)


def check_rotary_dim(head_dim: int, rotary_dim: int, who: str) -> None:
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{who}: rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")


def check_inv_freq(inv_freq: torch.Tensor | None, rotary_dim: int, device: torch.device, who: str,
                   scale: float = 1.0) -> None:
    """The table's shape, dtype and device; a scale other than 1.0 only with a table (the kernels'
    plain branch computes theta's cos and sin unscaled, where the reference would scale them)."""
    if inv_freq is None and scale != 1.0:
        raise ValueError(f"{who}: a cos/sin scale ({scale}) needs an inverse-frequency table (scaled RoPE)")
    if inv_freq is not None and (inv_freq.shape != (rotary_dim // 2,) or inv_freq.dtype != torch.float32
                                 or inv_freq.device != device or inv_freq.stride(0) != 1):
        raise ValueError(f"{who}: inv_freq must be a contiguous fp32 [{rotary_dim // 2}] tensor on {device}, got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)} on {inv_freq.device}")


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int,
            inv_freq: torch.Tensor | None, scale: float) -> torch.Tensor:
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        _rotary_kernel[(T, H)](x, out, positions, positions if inv_freq is None else inv_freq,
                               x.stride(0), x.stride(1), out.stride(0), out.stride(1), math.log2(theta), float(scale),
                               D, rotary_dim, rotary_dim // 2, triton.next_power_of_2(rotary_dim // 2),
                               triton.next_power_of_2(D), inv_freq is not None, num_warps=1)
    return out


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, theta: float,
                 rotary_dim: int | None = None, inv_freq: torch.Tensor | None = None, scale: float = 1.0):
    """positions [T], q [T, Hq, D], k [T, Hkv, D] (any row strides) -> rotated (q, k), contiguous.
    rotary_dim: the leading elements of each head that are rotated (None: all D); inv_freq [R/2] fp32
    (None: theta^(-2i/R)) and scale (cos and sin multiplied by it): scaled RoPE (YaRN)."""
    D = q.shape[-1]
    if D % 2 or k.shape[-1] != D:
        raise ValueError(f"apply_rotary: head_dim must be even and equal for q and k, got {D} and {k.shape[-1]}")
    rotary_dim = D if rotary_dim is None else rotary_dim
    check_rotary_dim(D, rotary_dim, "apply_rotary")
    check_inv_freq(inv_freq, rotary_dim, q.device, "apply_rotary", scale)
    return (_rotate(q, positions, theta, rotary_dim, inv_freq, scale),
            _rotate(k, positions, theta, rotary_dim, inv_freq, scale))
