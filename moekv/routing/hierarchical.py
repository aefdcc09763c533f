"""Hierarchical routing: a coarse gate picks clusters, the fine router scores only their experts.

Per token: the coarse gate scores the C clusters of the layer (C x H multiply-adds, fused into the
RMSNorm before the layer on the GPU); the best cluster is kept and its experts' logits computed
(M x H, M = E / C); the next clusters (up to clusters_per_token) are admitted only while their
coarse score is within admit_margin (plus the best cluster's own spread) of the best — a token
whose routing mass clearly sits in one cluster stays on one device, a token torn between two gets
both (the exact rule is cluster_routing_ref's). The fine router takes the model's top-k among the
kept experts, with the model's own scoring and renormalisation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moekv.ops.reference import cluster_routing_ref
from moekv.routing.cluster_map import LayerClusters
from moekv.routing.logits import RouterLogits


class HierarchicalRouter:
    name = "hierarchical"
    fuses_norm = True  # norm_and_coarse computes the norm and the coarse gate from one read of x

    def __init__(self, clusters: LayerClusters, gate: torch.Tensor, top_k: int, renormalize: bool,
                 clusters_per_token: int, admit_margin: float, scoring: str = "softmax",
                 scaling_factor: float = 1.0) -> None:
        C = clusters.num_clusters
        if not 1 <= clusters_per_token <= C:
            raise ValueError(f"clusters_per_token={clusters_per_token} must be in [1, number of clusters={C}]")
        if admit_margin != admit_margin:
            raise ValueError("cluster_admit_margin=nan is not a number; accepted: any real, -inf (one cluster) or inf")
        device, dtype = gate.device, gate.dtype
        self.cluster_experts = clusters.experts.to(device)  # [C, M]
        self.gate_by_cluster = gate.detach()[self.cluster_experts].contiguous()  # [C, M, H]
        self.coarse_weight = clusters.coarse_weight.to(device, dtype)  # [C, H]
        self.coarse_bias = clusters.coarse_bias.to(device, torch.float32)  # [C]
        self.top_k, self.renormalize = top_k, renormalize
        self.clusters_per_token, self.admit_margin = clusters_per_token, float(admit_margin)
        self.scoring, self.scaling_factor = scoring, scaling_factor

    @property
    def num_clusters(self) -> int:
        return int(self.cluster_experts.shape[0])

    def coarse_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, C] fp32."""
        return F.linear(hidden, self.coarse_weight).float() + self.coarse_bias

    def norm_and_coarse(self, x: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The RMSNorm before the layer and the coarse gate in one pass over x on the GPU."""
        if x.is_cuda:
            from moekv.ops.rms_norm_coarse_gate import rms_norm_coarse_gate

            return rms_norm_coarse_gate(x, norm.weight, norm.eps, self.coarse_weight, self.coarse_bias)
        hidden = norm(x)
        return hidden, self.coarse_scores(hidden)

    def __call__(self, hidden: torch.Tensor, router_logits: RouterLogits | torch.Tensor):
        gate = router_logits if isinstance(router_logits, RouterLogits) else None
        scores = gate.cluster_scores if gate is not None and gate.cluster_scores is not None else None
        if scores is None:
            scores = self.coarse_scores(hidden)  # [T, C]
        bias = gate.bias if gate is not None else None
        args = (hidden, scores, self.gate_by_cluster, self.cluster_experts, self.top_k, self.renormalize,
                self.clusters_per_token, self.admit_margin)
        kwargs = dict(scoring=self.scoring, bias=bias, scaling_factor=self.scaling_factor)
        if hidden.is_cuda:
            from moekv.ops.fused_routing import fused_cluster_routing

            return fused_cluster_routing(*args, **kwargs)
        return cluster_routing_ref(*args, **kwargs)


def router_flops_per_token(hidden_size: int, num_experts: int, num_clusters: int,
                           mean_clusters_per_token: float) -> dict:
    """Multiply-adds x 2 of the router per token: flat E*H against hierarchical C*H + kept*M*H."""
    flat = 2 * num_experts * hidden_size
    per_cluster = num_experts // num_clusters
    hier = 2 * hidden_size * (num_clusters + mean_clusters_per_token * per_cluster)
    return {"flat": flat, "hierarchical": hier, "saving": 1 - hier / flat}
