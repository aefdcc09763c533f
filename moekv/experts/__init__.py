"""Expert prediction and expert offload (issue 28).

- predictor.py: the next experts of each MoE layer from the residual stream entering it
  (pre-gating, or a fitted linear or MLP map from `moekv calibrate-experts`, optionally also
  reading the previous token's residual);
- offload.py: experts beyond a device budget in (pinned) host memory, a fixed-size on-device
  expert cache per layer, predicted experts copied in on a side stream before the layer runs;
- observe.py: the residual / router pairs a forward pass produces (calibration and evaluation).
"""
from __future__ import annotations

from moekv.experts.predictor import ExpertPredictor, recall

__all__ = ["ExpertPredictor", "recall"]
