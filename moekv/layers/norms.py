from __future__ import annotations

import torch
from torch import nn

from moekv.ops.reference import rms_norm_ref


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
