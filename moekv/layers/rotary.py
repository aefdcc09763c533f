from __future__ import annotations

import math

import torch
from torch import nn

from moekv.models.model_config import YarnRope
from moekv.ops.reference import apply_rotary_ref, rotary_cos_sin_ref


def yarn_inv_freq(head_dim: int, theta: float, yarn: YarnRope) -> torch.Tensor:
    """YaRN's inverse frequencies [D/2] (fp32): the original ones where a dimension rotates more than
    beta_fast times over the original context, the interpolated ones (/ factor) where it rotates
    fewer than beta_slow times, a linear blend between."""
    def correction_dim(rotations: float) -> float:
        turns = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    extrapolated = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    interpolated = extrapolated / yarn.factor
    keep_original = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return interpolated * (1 - keep_original) + extrapolated * keep_original


class RotaryEmbedding(nn.Module):
    """RoPE (rotate-half layout) applied to q [T, Hq, D] and k [T, Hkv, D] at their positions: plain
    at `theta`, or YaRN-scaled (`yarn`: its inverse frequencies as a table built once per device,
    cos and sin multiplied by its attention factor); with rotary_dim < head_dim (partial RoPE,
    GLM-4.5) only each head's first rotary_dim elements. The CUDA kernels (ops/rotary.py, the fused
    RoPE + KV write) take every variant; elsewhere the reference."""

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None,
                 yarn: YarnRope | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.rotary_dim = rotary_dim or head_dim
        self.yarn = yarn
        self.scale = 1.0 if yarn is None else yarn.attention_factor  # cos and sin multiplied by it
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # YaRN's, per device (the model is built on meta)

    def inv_freq(self, device: torch.device) -> torch.Tensor | None:
        """YaRN's inverse frequencies [rotary_dim / 2] (fp32) on `device`, built on the first call
        (a warm-up step, before any CUDA graph is captured); None for plain RoPE (theta^(-2i/R))."""
        if self.yarn is None:
            return None
        table = self._inv_freq.get(device)
        if table is None:
            table = self._inv_freq[device] = yarn_inv_freq(self.rotary_dim, self.theta, self.yarn).to(device)
        return table

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] in dtype (YaRN's attention factor multiplied in before the cast)."""
        return rotary_cos_sin_ref(positions, self.rotary_dim, self.theta, dtype, self.inv_freq(positions.device),
                                  self.scale)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if q.is_cuda:  # two launches instead of about twenty
            from moekv.ops.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.theta, self.rotary_dim, self.inv_freq(q.device), self.scale)
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary_ref(q, cos, sin), apply_rotary_ref(k, cos, sin)
