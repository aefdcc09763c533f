"""Routers: (hidden, router_logits) -> (weights [T, k], expert_ids [T, k]). The MoE layer does
not know which one produced its assignments."""
from moekv.routing.flat import FlatTopKRouter

__all__ = ["FlatTopKRouter"]
