from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.mlp import GatedMLP
from moekv.models.model_config import ModelConfig
from moekv.ops.reference import fused_moe_ref
from moekv.routing.base import Router, RouterLogits, RoutingObserver


class SparseMoE(nn.Module):
    """Router + stacked experts (+ an optional always-on shared expert with a sigmoid gate)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Parameter(torch.empty(E, H))  # router weights: logits = x @ gate.T
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H))  # per expert: gate rows, then up rows
        self.w2 = nn.Parameter(torch.empty(E, H, I))
        # DeepSeek-V3's selection bias (added to the scores for the choice only)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E)) if cfg.router_bias else None
        self.router: Router | None = None  # installed by the loader (models/loader.install_routers)
        self.observer: RoutingObserver | None = None  # the engine's counter of routing decisions, if any
        # expert offload (moekv/experts/offload.py): the experts run on an on-device expert cache
        self.offload = None
        self.shared_expert = (GatedMLP(H, cfg.shared_expert_intermediate_size)
                              if cfg.shared_expert_intermediate_size else None)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, H)) if cfg.shared_expert_intermediate_size else None
        # tensor / expert parallel (layers/parallel.py): this rank's share of the output, all-reduced;
        # ep: the rank's whole experts (an ExpertParallel), else a slice of every expert
        self.tp = None
        self.ep = None

    @property
    def router_fuses_norm(self) -> bool:
        """Whether the router computes the RMSNorm before the layer itself (with a coarse gate)."""
        return self.router is not None and self.router.fuses_norm

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x [T, H]: the normalised state, or, with `norm` given, the residual stream before the
        norm (a router with a coarse gate computes both from one read of x)."""
        if self.router is None:
            raise RuntimeError("this MoE layer has no router: models/loader.install_routers installs one")
        cluster_scores = None
        if norm is not None:
            x, cluster_scores = self.router.norm_and_coarse(x, norm)  # [T, H], [T, C] or None
        # logits [T, E] are computed only if the router reads them (hierarchical does not)
        router_logits = RouterLogits(x, self.gate, self.e_score_correction_bias, cluster_scores)
        weights, expert_ids = self.router(x, router_logits)  # [T, k], [T, k]
        if self.observer is not None:
            self.observer(weights, expert_ids)
        if self.offload is not None:  # experts in host memory, computed on the cache's slots
            out = self.offload(x, weights, expert_ids)
        elif self.ep is not None:  # this rank's experts (expert parallel)
            out = self.ep(x, self.w13, self.w2, weights, expert_ids)
        elif x.is_cuda:  # Triton grouped GEMM / decode GEMV, capturable in CUDA graphs; CPU keeps the reference
            from moekv.ops.fused_moe import fused_moe
            out = fused_moe(x, self.w13, self.w2, weights, expert_ids)
        else:
            out = fused_moe_ref(x, self.w13, self.w2, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)
