"""RouterTap: wraps a layer's router and hands every routing decision to a Python callback
(calibration for `moekv cluster`, statistics for `moekv eval routing`) without changing it. A tap
runs Python inside the step, so the engine runs tapped steps eagerly (`runs_python`); counting that
must survive CUDA-graph replay is a RoutingObserver installed by the engine instead."""
from __future__ import annotations

import torch


class RouterTap:
    runs_python = True  # a CUDA-graph replay would skip the callback

    def __init__(self, router, callback, layer_idx: int) -> None:
        self.inner = router
        self.callback = callback  # callback(layer_idx, hidden [T, H], router_logits, weights [T, k], ids [T, k])
        self.layer_idx = layer_idx
        self.name = getattr(router, "name", type(router).__name__)

    @property
    def fuses_norm(self) -> bool:
        return getattr(self.inner, "fuses_norm", False)

    def norm_and_coarse(self, x: torch.Tensor, norm):
        return self.inner.norm_and_coarse(x, norm)

    def __call__(self, hidden: torch.Tensor, router_logits):
        weights, ids = self.inner(hidden, router_logits)
        out = self.callback(self.layer_idx, hidden, router_logits, weights, ids)
        return (weights, ids) if out is None else out  # a callback may substitute the decision


class tapped:
    """with tapped(layers, callback): every given MoE layer's router (layers: layer index -> SparseMoE,
    e.g. models.loader.moe_layers(model)) reports to callback; restored on exit."""

    def __init__(self, layers: dict, callback) -> None:
        self.layers = layers
        self.callback = callback

    def __enter__(self):
        self.saved = {i: moe.hooks.router for i, moe in self.layers.items()}
        for i, moe in self.layers.items():
            moe.hooks.router = RouterTap(moe.hooks.router, self.callback, i)
        return self

    def __exit__(self, *exc) -> None:
        for i, moe in self.layers.items():
            moe.hooks.router = self.saved[i]
