"""Routers: (hidden, router_logits) -> (weights [T, k], expert_ids [T, k]) (the Router protocol of
routing/base.py). The MoE layer does not know which one produced its assignments; `router_logits`
is a RouterLogits that computes the [T, E] product only for routers that read it (flat,
group_limited), not for hierarchical. Here: the routers a checkpoint's config asks for; the loader
(models/loader.install_routers) installs them."""
from __future__ import annotations

from moekv.routing.base import Router, RoutingObserver
from moekv.routing.flat import FlatTopKRouter
from moekv.routing.group_limited import GroupLimitedRouter
from moekv.routing.hierarchical import HierarchicalRouter
from moekv.routing.logits import RouterLogits
from moekv.routing.modes import ROUTING_MODES

__all__ = ["FlatTopKRouter", "GroupLimitedRouter", "HierarchicalRouter", "Router", "RouterLogits", "RoutingObserver",
           "ROUTING_MODES", "checkpoint_router", "default_router", "group_limited_router", "resolve_routing"]


def resolve_routing(routing: str, model_cfg) -> str:
    """'auto': group_limited when the checkpoint's config carries n_group / topk_group, else flat."""
    if routing != "auto":
        return routing
    return "group_limited" if model_cfg.n_group and model_cfg.topk_group else "flat"


def checkpoint_router(model_cfg):
    """The model's own top-k over all experts (flat routing, with the checkpoint's scoring)."""
    if model_cfg.scoring_func == "softmax" and not model_cfg.router_bias and model_cfg.routed_scaling_factor == 1.0:
        return FlatTopKRouter(model_cfg.top_k, model_cfg.norm_topk_prob)
    # the model's own top-k with sigmoid scores / a selection bias / scaling: one group of all experts
    return GroupLimitedRouter(model_cfg.top_k, model_cfg.num_experts, 1, 1, model_cfg.norm_topk_prob,
                              model_cfg.scoring_func, model_cfg.routed_scaling_factor)


def group_limited_router(model_cfg, n_group: int | None = None, topk_group: int | None = None):
    """Group-limited routing with these groups (None: the checkpoint's)."""
    n_group = n_group or model_cfg.n_group
    topk_group = topk_group or model_cfg.topk_group
    if not n_group or not topk_group:
        raise ValueError("routing='group_limited' needs n_group and topk_group: the checkpoint's config.json has "
                         "none, so give both (n_group=..., topk_group=... / --n-group, --topk-group)")
    return GroupLimitedRouter(model_cfg.top_k, model_cfg.num_experts, n_group, topk_group, model_cfg.norm_topk_prob,
                              model_cfg.scoring_func, model_cfg.routed_scaling_factor, model_cfg.group_score)


def default_router(model_cfg):
    """The router a checkpoint asks for by itself (what routing='auto' gives)."""
    if resolve_routing("auto", model_cfg) == "group_limited":
        return group_limited_router(model_cfg)
    return checkpoint_router(model_cfg)
