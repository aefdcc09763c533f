"""Expert prediction: which experts MoE layer L will route to, from the residual stream entering
layer L (before its attention runs), so that they can be fetched while the attention computes.

Two predictors, both `scores(layer_idx, residual [T, H]) -> [T, E]` with the experts ranked by
score (`predict` takes the top n):
- pre-gating (no file): layer L's own router applied to layer L's post-attention RMSNorm of the
  residual entering layer L, i.e. the router evaluated on the state before the attention's update;
- fitted (a file from `moekv calibrate-experts`): one linear map per layer, [rms(r), 1] @ B with
  B [H + 1, E], fitted by ridge least squares on calibration text to layer L's true router logits
  and pulled toward the pre-gating map (so little data cannot make it worse than pre-gating by
  much). The file also holds each layer's routing frequency on the calibration text (what an
  expert cache keeps resident from the start).

Ranking uses the router's selection scores: logits for softmax routers; sigmoid(logits) + the
selection bias for sigmoid routers with one. Group limits (DeepSeek-V3) are not applied: the
prediction is a prefetch set, not a routing decision.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

PREDICTOR_FORMAT = "moekv-expert-predictor-1"
PROBE_COLUMNS = 4  # router columns saved to check a file against the model it is used with
DEFAULT_ALPHAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def recall(predicted: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per token: the share of its actual experts [T, k] found among the predicted ones [T, n]."""
    if actual.shape[0] == 0:
        return torch.zeros(0, device=actual.device)
    return (actual[:, :, None] == predicted[:, None, :]).any(-1).float().mean(-1)


@dataclass
class FittedLayer:
    weight: torch.Tensor  # [H + 1, E] fp32: [rms(r), 1] @ weight = predicted router logits
    frequency: torch.Tensor  # [E] fp32: tokens routed to each expert on the calibration text
    probe: torch.Tensor  # [E, PROBE_COLUMNS]: the router's first columns (checks the model)
    alpha: float = 0.0  # the ridge strength chosen (relative to the mean diagonal of X^T X)


@dataclass
class ExpertPredictor:
    """Scores of each MoE layer's experts from the residual stream entering that layer.

    model: the MoEDecoder it predicts for; fitted: layer -> FittedLayer (empty: pre-gating only).
    """

    model: object
    fitted: dict[int, FittedLayer] = field(default_factory=dict)
    source: str = "pregate"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from moekv.models.loader import moe_layers

        self.layers = moe_layers(self.model)
        cfg = self.model.config
        self.top_k = cfg.top_k
        self.eps = cfg.rms_norm_eps
        self.sigmoid = cfg.scoring_func == "sigmoid"
        self._device_weights: dict[int, torch.Tensor] = {}

    @property
    def kind(self) -> str:
        return "fitted" if self.fitted else "pregate"

    # -- prediction ------------------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, layer_idx: int, residual: torch.Tensor, pregate: bool | None = None) -> torch.Tensor:
        """Predicted router logits [T, E] (fp32) of MoE layer layer_idx from the residual [T, H]
        entering that layer. pregate: force pre-gating even when a fitted map exists."""
        moe = self.layers[layer_idx]
        if self.fitted and not pregate and layer_idx in self.fitted:
            w = self._device_weights.get(layer_idx)
            if w is None or w.device != residual.device:
                w = self._device_weights[layer_idx] = self.fitted[layer_idx].weight.to(residual.device)
            return torch.addmm(w[-1], rms(residual, self.eps), w[:-1])
        norm = self.model.layers[layer_idx].post_attention_layernorm
        h = norm(residual.to(norm.weight.dtype))
        return F.linear(h, moe.gate).float()

    def scores(self, layer_idx: int, residual: torch.Tensor, pregate: bool | None = None) -> torch.Tensor:
        """Selection scores [T, E]: what the router ranks experts by."""
        logits = self.logits(layer_idx, residual, pregate)
        return self._rank_scores(layer_idx, logits)

    def _rank_scores(self, layer_idx: int, logits: torch.Tensor) -> torch.Tensor:
        if not self.sigmoid:
            return logits
        bias = self.layers[layer_idx].e_score_correction_bias
        scores = torch.sigmoid(logits)
        return scores if bias is None else scores + bias.float()

    def predict(self, layer_idx: int, residual: torch.Tensor, n: int | None = None,
                pregate: bool | None = None) -> torch.Tensor:
        """The n (default top_k) most likely experts [T, n] of layer layer_idx, best first."""
        n = min(n or self.top_k, self.layers[layer_idx].gate.shape[0])
        return self.scores(layer_idx, residual, pregate).topk(n, dim=-1).indices

    def frequency(self, layer_idx: int) -> torch.Tensor | None:
        """Calibration routing counts [E] of the layer (None without a fitted file)."""
        f = self.fitted.get(layer_idx)
        return None if f is None else f.frequency

    # -- files ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        if not self.fitted:
            raise ValueError("a pre-gating predictor has nothing to save (fit one with `moekv calibrate-experts`)")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, f in self.fitted.items():
            tensors[f"layers.{i}.weight"] = f.weight.float().contiguous().cpu()
            tensors[f"layers.{i}.frequency"] = f.frequency.float().contiguous().cpu()
            tensors[f"layers.{i}.probe"] = f.probe.float().contiguous().cpu()
        cfg = self.model.config
        meta = {**self.meta, "format": PREDICTOR_FORMAT, "architecture": cfg.architecture,
                "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                "layers": sorted(self.fitted), "alphas": {str(i): f.alpha for i, f in self.fitted.items()}}
        save_file(tensors, str(path), metadata={"moekv": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path, model) -> "ExpertPredictor":
        """A fitted predictor from `moekv calibrate-experts`, checked against model: a file made for
        another model (architecture, sizes, layers or router weights) is refused with the reason."""
        from safetensors import safe_open

        from moekv.models.loader import moe_layers

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"expert_predictor={str(path)!r}: no such file (make one with `moekv calibrate-experts`)")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = json.loads((f.metadata() or {}).get("moekv", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"expert_predictor={str(path)!r} cannot be read: {e}") from e
        if meta.get("format") != PREDICTOR_FORMAT:
            raise ValueError(f"expert_predictor={str(path)!r} is not an expert predictor file "
                             f"(format {meta.get('format')!r}, expected {PREDICTOR_FORMAT!r})")
        cfg = model.config
        for key, want in (("architecture", cfg.architecture), ("hidden_size", cfg.hidden_size),
                          ("num_experts", cfg.num_experts), ("top_k", cfg.top_k)):
            if meta.get(key) != want:
                raise ValueError(f"expert_predictor={str(path)!r} was made for {key}={meta.get(key)!r}, "
                                 f"this model has {want!r}")
        layers = moe_layers(model)
        if sorted(meta.get("layers", [])) != sorted(layers):
            raise ValueError(f"expert_predictor={str(path)!r} covers MoE layers {meta.get('layers')}, "
                             f"this model has {sorted(layers)}")
        fitted = {}
        for i, moe in layers.items():
            probe = tensors[f"layers.{i}.probe"]
            mine = moe.gate[:, :PROBE_COLUMNS].detach().float().cpu()
            if probe.shape != mine.shape or not torch.allclose(probe, mine, rtol=1e-2, atol=1e-3):
                raise ValueError(f"expert_predictor={str(path)!r}: layer {i}'s router weights differ from this "
                                 "model's (the file was fitted on another checkpoint)")
            fitted[i] = FittedLayer(tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.frequency"], probe,
                                    float(meta.get("alphas", {}).get(str(i), 0.0)))
        return cls(model, fitted, source=str(path), meta=meta)


# -- fitting -------------------------------------------------------------------------------------
class PredictorFit:
    """Accumulates, per MoE layer, the normal equations of [rms(r), 1] @ B ~= true router logits,
    routing counts, and a held-out sample used to choose the ridge strength."""

    def __init__(self, model, holdout_every: int = 10, holdout_max: int = 8192) -> None:
        from moekv.models.loader import moe_layers

        self.model = model
        self.layers = moe_layers(model)
        self.predictor = ExpertPredictor(model)  # pre-gating: the prior and the baseline
        self.holdout_every = holdout_every
        self.holdout_max = holdout_max
        self.gram: dict[int, torch.Tensor] = {}
        self.cross: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.tokens: dict[int, int] = {}
        self._seen = 0

    @torch.no_grad()
    def add(self, layer_idx: int, residual: torch.Tensor, hidden: torch.Tensor, expert_ids: torch.Tensor) -> None:
        """One batch of layer layer_idx: residual [T, H] entering the layer, the router's input
        hidden [T, H] and its decision expert_ids [T, k]."""
        moe = self.layers[layer_idx]
        x = rms(residual, self.predictor.eps).double().cpu()
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)  # [T, H + 1]
        y = F.linear(hidden.float(), moe.gate.float()).double().cpu()  # [T, E] the true logits
        ids = expert_ids.cpu()
        held = torch.zeros(x.shape[0], dtype=torch.bool)
        n_held = sum(a.shape[0] for a, _ in self.held.get(layer_idx, []))
        if n_held < self.holdout_max:
            held[::self.holdout_every] = True
            held[self.holdout_max - n_held:] = False
            self.held.setdefault(layer_idx, []).append((x[held], ids[held]))
        fit = ~held
        if layer_idx not in self.gram:
            self.gram[layer_idx] = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
            self.cross[layer_idx] = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
            self.counts[layer_idx] = torch.zeros(y.shape[1], dtype=torch.float64)
            self.tokens[layer_idx] = 0
        self.gram[layer_idx] += x[fit].T @ x[fit]
        self.cross[layer_idx] += x[fit].T @ y[fit]
        self.counts[layer_idx] += torch.bincount(ids.reshape(-1), minlength=y.shape[1]).double()
        self.tokens[layer_idx] += int(fit.sum())

    def prior(self, layer_idx: int) -> torch.Tensor:
        """The pre-gating map as a [H + 1, E] matrix: diag(norm weight) @ gate^T, no bias."""
        moe = self.layers[layer_idx]
        w = self.model.layers[layer_idx].post_attention_layernorm.weight.detach().double().cpu()
        gate = moe.gate.detach().double().cpu()
        return torch.cat([w[:, None] * gate.T, torch.zeros(1, gate.shape[0], dtype=torch.float64)])

    def solve(self, layer_idx: int, alpha: float) -> torch.Tensor:
        """argmin ||X B - Y||^2 + lam ||B - prior||^2, lam = alpha x mean diagonal of X^T X."""
        g, c, b0 = self.gram[layer_idx], self.cross[layer_idx], self.prior(layer_idx)
        lam = alpha * float(g.diagonal().mean())
        eye = torch.eye(g.shape[0], dtype=g.dtype)
        return torch.linalg.solve(g + lam * eye, c + lam * b0)

    def held_recall(self, layer_idx: int, weight: torch.Tensor) -> float:
        parts = self.held.get(layer_idx, [])
        if not parts:
            return float("nan")
        x = torch.cat([a for a, _ in parts])
        ids = torch.cat([b for _, b in parts])
        k = ids.shape[1]
        scores = self.predictor._rank_scores(layer_idx, (x @ weight).float())
        return float(recall(scores.topk(k, -1).indices, ids).mean())

    def finish(self, alphas=DEFAULT_ALPHAS, meta: dict | None = None) -> tuple[ExpertPredictor, dict]:
        """The fitted predictor (ridge strength per layer chosen on the held-out tokens) and a
        summary: per layer, held-out recall of pre-gating and of the fit at each strength."""
        if not self.gram:
            raise ValueError("no tokens were seen: the calibration text is empty")
        fitted, summary = {}, {}
        for i in sorted(self.gram):
            pre = self.held_recall(i, self.prior(i))
            tried = {}
            best = None
            for alpha in alphas:
                w = self.solve(i, alpha)
                r = self.held_recall(i, w)
                tried[str(alpha)] = r
                if best is None or r > best[0] + 1e-9:
                    best = (r, alpha, w)
            r, alpha, w = best
            moe = self.layers[i]
            probe = moe.gate[:, :PROBE_COLUMNS].detach().float().cpu()
            fitted[i] = FittedLayer(w.float(), self.counts[i].float(), probe, alpha)
            summary[i] = {"tokens": self.tokens[i], "holdout_recall_pregate": pre, "holdout_recall_fitted": r,
                          "alpha": alpha, "holdout_recall_by_alpha": tried}
        return ExpertPredictor(self.model, fitted, source="fitted", meta=meta or {}), summary
