"""RouterTap: wraps a layer's router and hands every routing decision to a callback (calibration
for `moekv cluster`, statistics for `moekv eval routing`) without changing it."""
from __future__ import annotations

import torch


class RouterTap:
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


def moe_layers(model) -> dict[int, "torch.nn.Module"]:
    """Layer index -> its SparseMoE, for the layers that have experts."""
    from moekv.layers.moe import SparseMoE

    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)}


class tapped:
    """with tapped(model, callback): every MoE layer's router reports to callback; restored on exit."""

    def __init__(self, model, callback) -> None:
        self.layers = moe_layers(model)
        self.callback = callback

    def __enter__(self):
        self.saved = {i: moe.router for i, moe in self.layers.items()}
        for i, moe in self.layers.items():
            moe.router = RouterTap(moe.router, self.callback, i)
        return self

    def __exit__(self, *exc) -> None:
        for i, moe in self.layers.items():
            moe.router = self.saved[i]
