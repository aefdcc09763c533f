from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.mlp import GatedMLP
from moekv.models.model_config import ModelConfig
from moekv.ops.reference import fused_moe_ref
from moekv.routing import FlatTopKRouter


class SparseMoE(nn.Module):
    """Router + stacked experts (+ an optional always-on shared expert with a sigmoid gate)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Parameter(torch.empty(E, H))  # router weights: logits = x @ gate.T
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))  # per expert: gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        self.router = FlatTopKRouter(cfg.top_k, cfg.norm_topk_prob)
        self.shared_expert = GatedMLP(H, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        self.shared_expert_gate = nn.Parameter(torch.empty(1, H)) if cfg.shared_expert_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate)  # [T, E]
        weights, expert_ids = self.router(x, router_logits)  # [T, k], [T, k]
        out = fused_moe_ref(x, self.w13, self.w2, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out
