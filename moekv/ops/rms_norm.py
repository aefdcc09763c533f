"""RMSNorm in one launch, alone or after the residual add (the PyTorch reference, `rms_norm_ref`,
is six kernels: at batch 1 each decode step runs 65 norms, and in a CUDA graph every launch still
has its fixed cost). `add_rms_norm` adds a sublayer's output to the residual stream and normalises the
sum in the same pass (the add alone would be a launch of its own, 64 per step at batch 1).

Semantics are `rms_norm_ref`'s (`add_rms_norm_ref`'s) exactly: normalise in fp32, round to the
input dtype, multiply by the weight in that dtype. One program per row holds the whole row (BLOCK_H >= H) in registers.
Shape legend: T = rows (tokens), H = hidden size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.pdl import let_dependents_launch, pdl_enabled


@triton.jit
def normalize_row(x, w_ptr, offs, mask, H: tl.constexpr, eps):
    """rms_norm_ref on one row held whole: x [BLOCK_H] in the model dtype -> weight * normalised x,
    normalised in fp32 and rounded to the dtype before the weight, as the reference does."""
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / H + eps)
    normed = (x32 * rstd).to(x.dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, eps, H: tl.constexpr, BLOCK_H: tl.constexpr,
                     PDL: tl.constexpr):
    let_dependents_launch(PDL)  # the projection after a norm may become resident (ops/pdl.py)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, normalize_row(x, w_ptr, offs, mask, H, eps), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_d, stride_sum, stride_out, eps,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    let_dependents_launch(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + t * stride_d + offs, mask=mask, other=0.0)
    s = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # the residual stream, rounded as torch's add
    tl.store(sum_ptr + t * stride_sum + offs, s, mask=mask)
    tl.store(out_ptr + t * stride_out + offs, normalize_row(s, w_ptr, offs, mask, H, eps), mask=mask)


def _rows(x: torch.Tensor, H: int) -> torch.Tensor:
    rows = x.reshape(-1, H)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_shape(x: torch.Tensor, H: int) -> dict:
    return dict(BLOCK_H=triton.next_power_of_2(H), PDL=pdl_enabled(x.device), num_warps=4 if H <= 4096 else 8)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """x, delta [..., H] -> (x + delta, weight * normalised (x + delta)), both in x's dtype (as
    add_rms_norm_ref)."""
    H = x.shape[-1]
    if delta.shape != x.shape or delta.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, delta {tuple(delta.shape)} {delta.dtype}, "
                         f"weight {weight.dtype}: shapes and dtypes must match")
    rows, drows = _rows(x, H), _rows(delta, H)
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, drows, weight, total, out, rows.stride(0), drows.stride(0),
                                               total.stride(0), out.stride(0), float(eps), H, **_launch_shape(x, H))
    return total.reshape(x.shape), out.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * normalised x, in x's dtype (as rms_norm_ref; weight in x's dtype)."""
    H = x.shape[-1]
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    rows = _rows(x, H)
    out = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), float(eps), H,
                                           **_launch_shape(x, H))
    return out.reshape(x.shape)
