"""Router logits for small batches in one launch: logits [T, E] = hidden [T, H] @ gate [E, H].T
(+ a logit bias [E], gpt-oss's router: added to the fp32 sum before the rounding, F.linear's bias).

At decode (T = 1) cuBLAS runs this 8 x 4096 product as a split-K GEMM plus a reduce kernel, two
launches for 64 KB of weights (docs/decisions.md, "Small kernels of a batch-1 step"); one Triton
program per (token, block of expert) streams its gate row once and writes the logit in the hidden state's dtype, fp32
accumulation, as F.linear does. One expert per program and the whole row in one load: wider
programs would run the product on a few SMs as a chain of dependent loads.
Reference: `F.linear(hidden, gate, bias)` (`RouterLogits.full`).
Shape legend: T = tokens, E = experts, H = hidden size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 64  # beyond this the tensor-core GEMM wins: each program re-reads the gate from L2
MAX_EXPERTS = 256


@triton.jit
def _router_gemv_kernel(x_ptr, gate_ptr, bias_ptr, out_ptr, stride_xt, stride_ge, stride_ot,
                        E: tl.constexpr, H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                        HAS_BIAS: tl.constexpr):
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h_ok = offs_h + h0 < H
        x = tl.load(x_ptr + t * stride_xt + h0 + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(gate_ptr + offs_e[:, None] * stride_ge + h0 + offs_h[None, :],
                    mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    logits = tl.sum(acc, axis=1)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs_e, logits.to(out_ptr.dtype.element_ty), mask=e_ok)


def fits(hidden: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether router_gemv is the better launch for these shapes (small batch, few experts)."""
    return hidden.shape[0] <= MAX_TOKENS and gate.shape[0] <= MAX_EXPERTS


def router_gemv(hidden: torch.Tensor, gate: torch.Tensor, block_e: int = 1,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, H] @ gate [E, H].T (+ bias [E]) -> [T, E] in hidden's dtype. block_e: experts per program."""
    T, H = hidden.shape
    E = gate.shape[0]
    if gate.shape[1] != H:
        raise ValueError(f"router_gemv: gate {tuple(gate.shape)} does not match hidden {tuple(hidden.shape)}")
    if bias is not None and (bias.shape != (E,) or bias.device != hidden.device):
        raise ValueError(f"router_gemv: bias {tuple(bias.shape)} on {bias.device} is not one logit per expert "
                         f"({E}) on {hidden.device}")
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    g = gate if gate.stride(-1) == 1 else gate.contiguous()
    out = torch.empty(T, E, dtype=hidden.dtype, device=hidden.device)
    if T:
        block_h = min(triton.next_power_of_2(H), 8192)  # one load per program for H <= 8192
        block_e = triton.next_power_of_2(block_e)
        b = None if bias is None else bias.contiguous()
        _router_gemv_kernel[(T, triton.cdiv(E, block_e))](x, g, g if b is None else b, out, x.stride(0), g.stride(0),
                                                          out.stride(0), E, H, block_e, block_h, b is not None,
                                                          num_warps=4 if block_e * block_h <= 4096 else 8)
    return out
