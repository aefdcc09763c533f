from __future__ import annotations

import torch
from torch import nn

from moekv.ops.reference import apply_rotary_ref, rotary_cos_sin_ref


class RotaryEmbedding(nn.Module):
    """Plain RoPE (rotate-half layout) applied to q [T, Hq, D] and k [T, Hkv, D] at their positions;
    with rotary_dim < head_dim (partial RoPE, GLM-4.5) only each head's first rotary_dim elements."""

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rotary_dim = rotary_dim or head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if q.is_cuda:  # two launches instead of about twenty
            from moekv.ops.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.theta, self.rotary_dim)
        cos, sin = rotary_cos_sin_ref(positions, self.rotary_dim, self.theta, q.dtype)
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
