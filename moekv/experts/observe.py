"""Watching what expert prediction needs in a forward pass: for each MoE layer, the residual stream
entering the layer (what a predictor reads before the layer's attention) next to the router's input
and decision (what the predictor should have said). Python runs inside the step, so the engine
runs observed steps eagerly (the taps say `runs_python`)."""
from __future__ import annotations

import torch

from moekv.routing.tap import tapped


class observed:
    """with observed(model, callback): callback(layer_idx, residual [T, H], hidden [T, H],
    weights [T, k], expert_ids [T, k]) for every MoE layer of every step; removed on exit."""

    def __init__(self, model, callback) -> None:
        from moekv.models.loader import moe_layers

        self.model = model
        self.callback = callback
        self.layers = moe_layers(model)
        self._residual: dict[int, torch.Tensor] = {}
        self._handles = []
        self.ctx = None  # the step's Context (positions, sequence boundaries) while a step runs

    def _pre_hook(self, layer_idx: int):
        def hook(module, args):
            x, delta = args[0], args[1]
            self.ctx = args[2] if len(args) > 2 else None
            self._residual[layer_idx] = x if delta is None else x + delta
        return hook

    def _tap(self, layer_idx, hidden, router_logits, weights, ids):
        self.callback(layer_idx, self._residual.pop(layer_idx), hidden, weights, ids)

    def __enter__(self):
        for i in self.layers:
            self._handles.append(self.model.layers[i].register_forward_pre_hook(self._pre_hook(i)))
        self._tapped = tapped(self.layers, self._tap).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tapped.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._residual.clear()
        self.ctx = None


def sequence_starts(ctx, num_rows: int, device=None) -> torch.Tensor | None:
    """bool [T]: True at the first row of each sequence of the step (from ctx.query_start_loc);
    None without a Context."""
    if ctx is None:
        return None
    qsl = ctx.host.query_start if ctx.host is not None else ctx.query_start_loc.tolist()
    starts = torch.zeros(num_rows, dtype=torch.bool, device=device)
    starts[[q for q in qsl[:-1] if q < num_rows]] = True
    return starts
