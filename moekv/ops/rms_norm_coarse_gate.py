"""RMSNorm fused with the coarse gate of hierarchical routing: one read of the residual stream
writes both the normalised state (for the experts and the fine router) and the cluster scores.

Semantics are `rms_norm_coarse_gate_ref`'s: normed = weight * (x * rsqrt(mean(x^2) + eps)) in the
model dtype (rounded as rms_norm_ref rounds), scores = normed @ coarse_weight.T + coarse_bias in
fp32. One program per token holds its whole row (BLOCK_H >= H) in registers: x is read once, the
C coarse rows are read from L2 (they are shared by every token).
Shape legend: T = tokens, H = hidden size, C = clusters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moekv.ops.rms_norm import normalize_row


@triton.jit
def _rms_norm_coarse_gate_kernel(x_ptr, norm_w_ptr, coarse_w_ptr, coarse_b_ptr, out_ptr, scores_ptr,
                                 stride_x, stride_out, eps,
                                 H: tl.constexpr, C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                                 HAS_BIAS: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    x = tl.load(x_ptr + t * stride_x + offs_h, mask=mask_h, other=0.0)
    normed = normalize_row(x, norm_w_ptr, offs_h, mask_h, H, eps)  # as rms_norm_ref
    tl.store(out_ptr + t * stride_out + offs_h, normed, mask=mask_h)
    n32 = normed.to(tl.float32)
    offs_c = tl.arange(0, BLOCK_C)
    scores = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c in tl.static_range(C):
        row = tl.load(coarse_w_ptr + c * H + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        scores = tl.where(offs_c == c, tl.sum(row * n32, 0), scores)
    if HAS_BIAS:
        scores += tl.load(coarse_b_ptr + offs_c, mask=offs_c < C, other=0.0).to(tl.float32)
    tl.store(scores_ptr + t * C + offs_c, scores, mask=offs_c < C)


def rms_norm_coarse_gate(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, coarse_weight: torch.Tensor,
                         coarse_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (normalised x [T, H] in x.dtype, cluster scores [T, C] fp32); see rms_norm_coarse_gate_ref."""
    num_tokens, hidden_size = x.shape
    num_clusters = coarse_weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    scores = torch.empty(num_tokens, num_clusters, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out, scores
    block_h = triton.next_power_of_2(hidden_size)
    _rms_norm_coarse_gate_kernel[(num_tokens,)](
        x, norm_weight.contiguous(), coarse_weight.contiguous(),
        coarse_bias if coarse_bias is not None else scores, out, scores, x.stride(0), out.stride(0), float(eps),
        H=hidden_size, C=num_clusters, BLOCK_H=block_h, BLOCK_C=triton.next_power_of_2(num_clusters),
        HAS_BIAS=coarse_bias is not None, num_warps=max(1, min(16, block_h // 256)))
    return out, scores
