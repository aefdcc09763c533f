from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.mlp import GatedMLP
from moekv.models.model_config import ModelConfig
from moekv.ops.reference import fused_moe_ref
from moekv.routing.base import Router, RouterLogits, RoutingObserver


class ExpertExecutor(Protocol):
    """How an MoE layer computes its routed experts, chosen once when the layer is built or its
    experts move (models/loader.empty_model: the local kind for the model's device; then expert
    parallelism's ExpertParallel, layers/parallel.py, or expert offload's OffloadedExperts,
    experts/offload.py): (x [T, H], w13 [E, 2I, H], w2 [E, H, I] as the module holds them,
    weights [T, k], expert_ids [T, k]) -> this rank's routed output [T, H]."""

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 expert_ids: torch.Tensor) -> torch.Tensor: ...


class ReferenceExperts:
    """Every expert on this device, through the plain-PyTorch reference (the CPU path)."""

    def __call__(self, x, w13, w2, weights, expert_ids):
        return fused_moe_ref(x, w13, w2, weights, expert_ids)


class FusedExperts:
    """Every expert on this device, through the Triton grouped GEMM / decode GEMV (ops/fused_moe.py),
    capturable in CUDA graphs."""

    def __call__(self, x, w13, w2, weights, expert_ids):
        from moekv.ops.fused_moe import fused_moe

        return fused_moe(x, w13, w2, weights, expert_ids)


def local_experts(device: torch.device) -> ExpertExecutor:
    """The executor of a layer whose experts all live on `device`: the kernel on CUDA, the reference elsewhere."""
    return FusedExperts() if device.type == "cuda" else ReferenceExperts()


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
        self.experts: ExpertExecutor | None = None  # installed by the loader (models/loader.empty_model)
        self.shared_expert = (GatedMLP(H, cfg.shared_expert_intermediate_size)
                              if cfg.shared_expert_intermediate_size else None)
        self.shared_expert_gate = nn.Parameter(torch.empty(1, H)) if cfg.shared_expert_intermediate_size else None
        # tensor parallel (layers/parallel.py): this rank's share of the output (a slice of every
        # expert, or with expert parallelism its whole experts), all-reduced
        self.tp = None

    @property
    def router_fuses_norm(self) -> bool:
        """Whether the router computes the RMSNorm before the layer itself (with a coarse gate)."""
        return self.router is not None and self.router.fuses_norm

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x [T, H]: the normalised state, or, with `norm` given, the residual stream before the
        norm (a router with a coarse gate computes both from one read of x)."""
        if self.router is None:
            raise RuntimeError("this MoE layer has no router: models/loader.install_routers installs one")
        if self.experts is None:
            raise RuntimeError("this MoE layer has no expert executor: models/loader.empty_model installs one")
        cluster_scores = None
        if norm is not None:
            x, cluster_scores = self.router.norm_and_coarse(x, norm)  # [T, H], [T, C] or None
        # logits [T, E] are computed only if the router reads them (hierarchical does not)
        router_logits = RouterLogits(x, self.gate, self.e_score_correction_bias, cluster_scores)
        weights, expert_ids = self.router(x, router_logits)  # [T, k], [T, k]
        if self.observer is not None:
            self.observer(weights, expert_ids)
        out = self.experts(x, self.w13, self.w2, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)
