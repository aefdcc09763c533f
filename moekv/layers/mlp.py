from __future__ import annotations

import torch
from torch import nn

from moekv.layers.attention import project
from moekv.layers.hooks import LayerHooks
from moekv.ops.reference import silu_and_mul_ref


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix [2I, H]; both projections
    through layers/attention.project (a decode token on CUDA: the dense GEMV)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hooks: LayerHooks | None = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, intermediate_size))
        # its layer's hooks (a shared expert has its own): with hooks.tp, a slice of I per rank, the output all-reduced
        self.hooks = hooks if hooks is not None else LayerHooks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = project(silu_and_mul_ref(project(x, self.gate_up_proj)), self.down_proj)
        tp = self.hooks.tp
        return out if tp is None else tp.all_reduce(out)
