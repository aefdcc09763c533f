"""Routers: (hidden, router_logits) -> (weights [T, k], expert_ids [T, k]). The MoE layer does
not know which one produced its assignments; `router_logits` is a RouterLogits that computes the
[T, E] product only for routers that read it (flat, group_limited), not for hierarchical."""
from __future__ import annotations

from moekv.routing.flat import FlatTopKRouter
from moekv.routing.group_limited import GroupLimitedRouter
from moekv.routing.hierarchical import HierarchicalRouter
from moekv.routing.logits import RouterLogits

ROUTING_MODES = ("auto", "flat", "group_limited", "hierarchical")

__all__ = ["FlatTopKRouter", "GroupLimitedRouter", "HierarchicalRouter", "RouterLogits", "ROUTING_MODES",
           "default_router", "resolve_routing", "install_routers"]


def resolve_routing(routing: str, model_cfg) -> str:
    """'auto': group_limited when the checkpoint's config carries n_group / topk_group, else flat."""
    if routing != "auto":
        return routing
    return "group_limited" if model_cfg.n_group and model_cfg.topk_group else "flat"


def _flat(model_cfg):
    if model_cfg.scoring_func == "softmax" and not model_cfg.router_bias and model_cfg.routed_scaling_factor == 1.0:
        return FlatTopKRouter(model_cfg.top_k, model_cfg.norm_topk_prob)
    # the model's own top-k with sigmoid scores / a selection bias / scaling: one group of all experts
    return GroupLimitedRouter(model_cfg.top_k, model_cfg.num_experts, 1, 1, model_cfg.norm_topk_prob,
                              model_cfg.scoring_func, model_cfg.routed_scaling_factor)


def _group_limited(model_cfg, n_group: int | None, topk_group: int | None):
    n_group = n_group or model_cfg.n_group
    topk_group = topk_group or model_cfg.topk_group
    if not n_group or not topk_group:
        raise ValueError("routing='group_limited' needs n_group and topk_group: the checkpoint's config.json has "
                         "none, so give both (n_group=..., topk_group=... / --n-group, --topk-group)")
    return GroupLimitedRouter(model_cfg.top_k, model_cfg.num_experts, n_group, topk_group, model_cfg.norm_topk_prob,
                              model_cfg.scoring_func, model_cfg.routed_scaling_factor)


def default_router(model_cfg):
    """The router a checkpoint asks for by itself (what routing='auto' gives)."""
    if resolve_routing("auto", model_cfg) == "group_limited":
        return _group_limited(model_cfg, None, None)
    return _flat(model_cfg)


def install_routers(model, model_cfg, routing: str = "auto", cluster_map=None, clusters_per_token: int | None = None,
                    admit_margin: float | None = None, n_group: int | None = None,
                    topk_group: int | None = None) -> str:
    """Give every MoE layer of a loaded model the chosen router; returns the resolved mode.

    cluster_map: a ClusterMap or the path of one (checked against the model, layer by layer)."""
    from moekv.layers.moe import SparseMoE
    from moekv.routing.cluster_map import ClusterMap

    mode = resolve_routing(routing, model_cfg)
    if mode not in ROUTING_MODES[1:]:
        raise ValueError(f"routing={routing!r} is unknown; accepted: {list(ROUTING_MODES)}")
    layers = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}
    if mode == "hierarchical":
        if cluster_map is None:
            raise ValueError("routing='hierarchical' needs cluster_map (a file from `moekv cluster`)")
        source = "" if isinstance(cluster_map, ClusterMap) else str(cluster_map)
        cmap = cluster_map if isinstance(cluster_map, ClusterMap) else ClusterMap.load(cluster_map)
        cmap.check_model(model_cfg, {i: moe.gate for i, moe in layers.items()}, source=source)
        per_token = min(clusters_per_token or cmap.clusters_per_token or cmap.num_clusters, cmap.num_clusters)
        for i, moe in layers.items():
            margin = cmap.layers[i].admit_margin if admit_margin is None else admit_margin
            moe.router = HierarchicalRouter(cmap.layers[i], moe.gate, model_cfg.top_k, model_cfg.norm_topk_prob,
                                            per_token, margin, model_cfg.scoring_func, model_cfg.routed_scaling_factor)
        return mode
    for moe in layers.values():
        moe.router = _group_limited(model_cfg, n_group, topk_group) if mode == "group_limited" else _flat(model_cfg)
    return mode
