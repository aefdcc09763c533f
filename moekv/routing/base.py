"""What an MoE layer needs of a router (the Router protocol) and of a counter of its decisions
(the RoutingObserver protocol). layers/moe.py depends on this module only; the loader
(models/loader.install_routers) builds the routers and installs them."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from moekv.routing.logits import RouterLogits

__all__ = ["Router", "RouterLogits", "RoutingObserver"]


@runtime_checkable
class Router(Protocol):
    """(hidden [T, H], router_logits) -> (weights [T, k], expert_ids [T, k], best first).

    name: the routing mode it implements ('flat', 'group_limited', 'hierarchical').
    fuses_norm: True when norm_and_coarse computes more than the norm (a coarse gate), so the layer
        hands it the residual stream before the RMSNorm.
    """

    name: str
    fuses_norm: bool

    def __call__(self, hidden: torch.Tensor, router_logits: RouterLogits | torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def norm_and_coarse(self, x: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RMSNorm before the layer and, for a router with a coarse gate, its cluster scores [T, C]."""
        ...


class RoutingObserver(Protocol):
    """Sees every routing decision of one MoE layer inside the forward pass. Kept to in-place device
    ops (no host sync), so a CUDA graph captures it and each replay counts again."""

    def __call__(self, weights: torch.Tensor, expert_ids: torch.Tensor) -> None: ...
