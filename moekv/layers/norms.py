from __future__ import annotations

import torch
from torch import nn

from moekv.ops.reference import add_rms_norm_ref, rms_norm_ref


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype:  # one launch instead of six
            from moekv.ops.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return rms_norm_ref(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual step: (x + delta, norm(x + delta)); delta None: (x, norm(x))."""
        if delta is None:
            return x, self(x)
        if x.is_cuda and x.dtype == self.weight.dtype == delta.dtype:  # one launch instead of two
            from moekv.ops.rms_norm import add_rms_norm

            return add_rms_norm(x, delta, self.weight, self.eps)
        return add_rms_norm_ref(x, delta, self.weight, self.eps)
