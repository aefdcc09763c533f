from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.ops.reference import silu_and_mul_ref


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix [2I, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        self.tp = None  # tensor parallel (layers/parallel.py): a slice of I per rank, the output all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(silu_and_mul_ref(F.linear(x, self.gate_up_proj)), self.down_proj)
        return out if self.tp is None else self.tp.all_reduce(out)
