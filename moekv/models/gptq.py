"""GPTQ rounding of INT4 experts (Frantar et al., 2022): each column is rounded in turn and its rounding
error spread over the columns not yet rounded, weighted by the inverse of the layer inputs' second
moment H = X^T X, so the error of X W^T rather than of W is kept small.

`ExpertInputs` wraps a MoE layer's ExpertExecutor and accumulates, per expert, H of the rows routed to
it (for w13: the layer's input x; for w2: silu(x W1^T) * (x W3^T) from the 16-bit weights);
`gptq_int4` rounds one [N, K] matrix into quantize-on-load's int4 layout (groups of 128 with zero
points, each group's scale and zero point taken when its first column comes up, from the columns
as the error updates left them). Columns in natural order (no act-order), blocks of one group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.ops.quantized_weight import INT4_GROUP, QuantizedWeight, pack_int4, quantize_int4

DAMP = 0.01  # of the mean diagonal of H, added to it (keeps the Cholesky factor well conditioned)


class ExpertInputs:
    """An ExpertExecutor that runs the wrapped one and adds each expert's routed rows to its
    second-moment matrices: h13[e] = sum x x^T (H x H), h2[e] = sum a a^T (I x I), fp64, on x's device."""

    def __init__(self, inner, num_experts: int, hidden: int, intermediate: int, device: torch.device) -> None:
        self.inner = inner
        self.h13 = torch.zeros(num_experts, hidden, hidden, dtype=torch.float64, device=device)
        self.h2 = torch.zeros(num_experts, intermediate, intermediate, dtype=torch.float64, device=device)
        self.rows = torch.zeros(num_experts, dtype=torch.int64)

    def __call__(self, x, w13, w2, weights, expert_ids):
        for expert in torch.unique(expert_ids).tolist():
            tokens = torch.where(expert_ids == expert)[0]
            xe = x[tokens].double()
            gate, up = F.linear(xe, w13[expert].double()).chunk(2, dim=-1)
            act = F.silu(gate) * up
            self.h13[expert] += xe.T @ xe
            self.h2[expert] += act.T @ act
            self.rows[expert] += len(tokens)
        return self.inner(x, w13, w2, weights, expert_ids)


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = INT4_GROUP,
              scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    """w [N, K] rounded to INT4 (zero points, groups of group_size along K) minimising the error of
    x w^T over inputs whose second moment is hessian [K, K]; round-to-nearest where H is 0."""
    N, K = w.shape
    scale_dtype = scale_dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32)
    if not hessian.abs().sum():
        return quantize_int4(w, group_size, zero_point=True, scale_dtype=scale_dtype)
    W = w.double().clone()
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += DAMP * torch.diag(H).mean() * torch.eye(K, dtype=H.dtype, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    groups = -(-K // group_size)
    codes = torch.zeros(N, K, dtype=torch.int64, device=w.device)
    scales = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    zeros = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    for g, start in enumerate(range(0, K, group_size)):
        stop = min(start + group_size, K)
        block = W[:, start:stop].clone()
        lo, hi = block.amin(1).clamp_max(0.0), block.amax(1).clamp_min(0.0)
        s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
        z = (-lo / s.double()).round().clamp(0, 15).to(scale_dtype)
        scales[:, g], zeros[:, g] = s, z
        s64, z64 = s.double(), z.double()
        Hinv_block = Hinv[start:stop, start:stop]
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            col = block[:, i]
            q = (col / s64 + z64).round().clamp(0, 15)
            codes[:, start + i] = q.long()
            err = (col - (q - z64) * s64) / Hinv_block[i, i]
            block[:, i:] -= err[:, None] * Hinv_block[i, i:][None, :]
            errors[:, i] = err
        W[:, stop:] -= errors @ Hinv[start:stop, stop:]
    return QuantizedWeight("int4", (N, K), pack_int4(codes), scales, (1, group_size), zeros)


def gptq_stacked(w: torch.Tensor, hessians: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedWeight:
    """gptq_int4 of each expert of a stacked [E, N, K] weight with its own hessians[e], stacked."""
    parts = [gptq_int4(w[e], hessians[e].to(w.device), group_size) for e in range(w.shape[0])]
    return QuantizedWeight("int4", tuple(w.shape), torch.stack([p.codes for p in parts]),
                           torch.stack([p.scales for p in parts]), (1, group_size),
                           torch.stack([p.zeros for p in parts]))
