"""GPTQ rounding of INT4 weights (Frantar et al., 2022): each column is rounded in turn and its rounding
error spread over the columns not yet rounded, weighted by the inverse of the layer inputs' second
moment H = X^T X, so the error of X W^T rather than of W is kept small.

`ExpertInputs` wraps a MoE layer's ExpertExecutor and accumulates, per expert, H of the rows routed to
it (for w13: the layer's input x; for w2: silu(x W1^T) * (x W3^T) from the 16-bit weights);
`InputMoments` accumulates H of other weights' inputs (the attention projections' and the LM head's,
fed by the decoder's projection_observer / hidden_observer hooks). `gptq_int4` rounds one [N, K]
matrix into quantize-on-load's int4 layout (groups of 128 with zero points, each group's scale and
zero point taken when its first column comes up, from the columns as the error updates left them).
Columns in natural order by default, blocks of one group; act_order is kept for measurements (on
domain-moe it lost to natural order: docs/decisions.md, "int4 with a calibration text").
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


class InputMoments:
    """Second moments sum x x^T (fp64, on x's device) of the rows each named weight sees, added up
    over calls: `observe(name, x)` with x [T, K]."""

    def __init__(self) -> None:
        self.h: dict[str, torch.Tensor] = {}

    def observe(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        moment = x.T @ x
        self.h[name] = self.h[name] + moment if name in self.h else moment


@torch.no_grad()
def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group_size: int = INT4_GROUP,
              scale_dtype: torch.dtype | None = None, act_order: bool = False) -> QuantizedWeight:
    """w [N, K] rounded to INT4 (zero points, groups of group_size along K) minimising the error of
    x w^T over inputs whose second moment is hessian [K, K]; round-to-nearest where H is 0.

    act_order: columns rounded in descending order of H's diagonal (the inputs with the most energy
    first, while the most columns are left to absorb their error), each group's scale and zero point
    taken from the unrounded weight before any column moves ("static groups": the groups stay the
    contiguous runs of group_size features of the layout). Otherwise columns go in natural order and
    a group's scale and zero point come from its columns as the earlier groups' errors left them."""
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
    groups = -(-K // group_size)
    scales = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    zeros = torch.zeros(N, groups, dtype=scale_dtype, device=w.device)
    if act_order:
        static = quantize_int4(W, group_size, zero_point=True, scale_dtype=scale_dtype)
        scales.copy_(static.scales)
        zeros.copy_(static.zeros)
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    else:
        perm = torch.arange(K, device=w.device)
    W, H = W[:, perm], H[perm][:, perm]
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    group_of = (perm // group_size).tolist()  # the group of each column in rounding order
    codes = torch.zeros(N, K, dtype=torch.int64, device=w.device)
    for start in range(0, K, group_size):  # blocks of group_size columns in rounding order
        stop = min(start + group_size, K)
        block = W[:, start:stop].clone()
        if not act_order:  # the block is group start // group_size
            lo, hi = block.amin(1).clamp_max(0.0), block.amax(1).clamp_min(0.0)
            s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
            scales[:, start // group_size] = s
            zeros[:, start // group_size] = (-lo / s.double()).round().clamp(0, 15).to(scale_dtype)
        Hinv_block = Hinv[start:stop, start:stop]
        errors = torch.zeros_like(block)
        for i in range(stop - start):
            g = group_of[start + i]
            s64, z64 = scales[:, g].double(), zeros[:, g].double()
            col = block[:, i]
            q = (col / s64 + z64).round().clamp(0, 15)
            codes[:, perm[start + i]] = q.long()
            err = (col - (q - z64) * s64) / Hinv_block[i, i]
            block[:, i:] -= err[:, None] * Hinv_block[i, i:][None, :]
            errors[:, i] = err
        W[:, stop:] -= errors @ Hinv[start:stop, stop:]
    return QuantizedWeight("int4", (N, K), pack_int4(codes), scales, (1, group_size), zeros)


def gptq_stacked(w: torch.Tensor, hessians: torch.Tensor, group_size: int = INT4_GROUP,
                 act_order: bool = False) -> QuantizedWeight:
    """gptq_int4 of each expert of a stacked [E, N, K] weight with its own hessians[e], stacked."""
    parts = [gptq_int4(w[e], hessians[e].to(w.device), group_size, act_order=act_order) for e in range(w.shape[0])]
    return QuantizedWeight("int4", tuple(w.shape), torch.stack([p.codes for p in parts]),
                           torch.stack([p.scales for p in parts]), (1, group_size),
                           torch.stack([p.zeros for p in parts]))
