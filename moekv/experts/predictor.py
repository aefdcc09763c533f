"""Expert prediction: which experts MoE layer L will route to, from the residual stream entering
layer L (before its attention runs), so that they can be fetched while the attention computes.

Two predictors, both `scores(layer_idx, residual [T, H]) -> [T, E]` with the experts ranked by
score (`predict` takes the top n):
- pre-gating (no file): layer L's own router applied to layer L's post-attention RMSNorm of the
  residual entering layer L, i.e. the router evaluated on the state before the attention's update;
- fitted (a file from `moekv calibrate-experts`): one map per layer from x = [rms(r), 1] to the
  router logits. `linear` (the default): x @ B with B [H + 1, E], fitted by ridge least squares on
  calibration text to layer L's true router logits and pulled toward the pre-gating map (so little
  data cannot make it worse than pre-gating by much). `mlp`: x @ B + gelu(x @ U) @ V (U [I + 1, h],
  V [h, E]), B started from the ridge fit, all trained to the router's softmax (KL), the epoch
  chosen on held-out calibration sequences. With `previous_token`, x also holds rms of the residual
  entering layer L at the sequence's previous token (zeros at a sequence's first token): I = 2H.
  That row was computed before this token's step (decode) or sits beside it in the step (prefill),
  so it is known before layer L's attention; `eval experts` and expert offload (lookahead 1, one
  kept row per sequence slot and layer) supply it; the L2 prefetch refuses such a file.
  The file also holds each layer's routing frequency on the calibration text (what an expert cache
  keeps resident from the start).

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


def previous_rows(residual: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's previous row of its sequence [T, H] (zeros at a sequence's first row).
    starts: bool [T], True where a sequence starts in the step (None: one sequence). A chunk that
    continues a sequence gets zeros at its first row too (the previous row is in an earlier step)."""
    prev = torch.zeros_like(residual)
    prev[1:] = residual[:-1]
    if starts is not None:
        prev[starts] = 0
    else:
        prev[:1] = 0
    return prev


def map_input(residual: torch.Tensor, previous: torch.Tensor | None, eps: float) -> torch.Tensor:
    """[rms(r), 1], or [rms(r), rms(previous), 1] (fp32): what a fitted map reads."""
    parts = [rms(residual, eps)]
    if previous is not None:
        parts.append(rms(previous, eps))
    parts.append(torch.ones(residual.shape[0], 1, dtype=torch.float32, device=residual.device))
    return torch.cat(parts, 1)


def map_logits(x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor | None = None,
               down: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, I + 1] (last column 1) -> logits [T, E]: x @ weight (+ gelu(x @ up) @ down)."""
    out = x @ weight
    if up is not None:
        out = out + F.gelu(x @ up) @ down
    return out


@dataclass
class FittedLayer:
    weight: torch.Tensor  # [I + 1, E] fp32: [features, 1] @ weight = predicted router logits (linear part)
    frequency: torch.Tensor  # [E] fp32: tokens routed to each expert on the calibration text
    probe: torch.Tensor  # [E, PROBE_COLUMNS]: the router's first columns (checks the model)
    alpha: float = 0.0  # the ridge strength chosen (relative to the mean diagonal of X^T X)
    up: torch.Tensor | None = None  # [I + 1, h] (mlp maps): the hidden layer
    down: torch.Tensor | None = None  # [h, E]

    previous_token: bool = False  # the map reads the previous token's residual too (I = 2H)


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

    @property
    def needs_previous(self) -> bool:
        """Whether the fitted maps read the previous token's residual (see previous_rows)."""
        return any(f.previous_token for f in self.fitted.values())

    def check_engine_use(self, option: str) -> None:
        """The L2 prefetch passes only the step's residual: a map that reads the previous token's
        residual is refused there (it would see zeros at every decode step); expert offload keeps
        it per sequence (offload.PreviousResidual)."""
        if self.needs_previous:
            raise ValueError(f"{option}: expert_predictor={self.source!r} reads the previous token's residual "
                             "(calibrate-experts --previous-token), which this path does not keep per sequence "
                             "yet (expert offload does); fit one without --previous-token for it")

    # -- prediction ------------------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, layer_idx: int, residual: torch.Tensor, pregate: bool | None = None,
               previous: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted router logits [T, E] (fp32) of MoE layer layer_idx from the residual [T, H]
        entering that layer. pregate: force pre-gating even when a fitted map exists. previous:
        the residual entering the layer at each row's previous token [T, H] (previous_rows), read
        by maps fitted with previous_token (None there: zeros, as at a sequence's first token)."""
        moe = self.layers[layer_idx]
        if self.fitted and not pregate and layer_idx in self.fitted:
            f = self.fitted[layer_idx]
            w = self._device_weights.get(layer_idx)
            if w is None or w[0].device != residual.device:
                w = self._device_weights[layer_idx] = tuple(
                    None if t is None else t.to(residual.device) for t in (f.weight, f.up, f.down))
            if f.up is None and not f.previous_token:
                return torch.addmm(w[0][-1], rms(residual, self.eps), w[0][:-1])
            if f.previous_token and previous is None:
                previous = torch.zeros_like(residual)
            x = map_input(residual, previous if f.previous_token else None, self.eps)
            return map_logits(x, *w)
        norm = self.model.layers[layer_idx].post_attention_layernorm
        h = norm(residual.to(norm.weight.dtype))
        return F.linear(h, moe.gate).float()

    def scores(self, layer_idx: int, residual: torch.Tensor, pregate: bool | None = None,
               previous: torch.Tensor | None = None) -> torch.Tensor:
        """Selection scores [T, E]: what the router ranks experts by."""
        logits = self.logits(layer_idx, residual, pregate, previous)
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
            if f.up is not None:  # the hidden layer in fp16: half the bytes, far below the fit's noise
                tensors[f"layers.{i}.up"] = f.up.half().contiguous().cpu()
                tensors[f"layers.{i}.down"] = f.down.half().contiguous().cpu()
        cfg = self.model.config
        meta = {**self.meta, "format": PREDICTOR_FORMAT, "architecture": cfg.architecture,
                "hidden_size": cfg.hidden_size, "num_experts": cfg.num_experts, "top_k": cfg.top_k,
                "layers": sorted(self.fitted), "alphas": {str(i): f.alpha for i, f in self.fitted.items()},
                "map": "mlp" if any(f.up is not None for f in self.fitted.values()) else "linear",
                "previous_token": self.needs_previous}
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
            up, down = tensors.get(f"layers.{i}.up"), tensors.get(f"layers.{i}.down")
            fitted[i] = FittedLayer(tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.frequency"], probe,
                                    float(meta.get("alphas", {}).get(str(i), 0.0)),
                                    None if up is None else up.float(), None if down is None else down.float(),
                                    bool(meta.get("previous_token", False)))
        return cls(model, fitted, source=str(path), meta=meta)


# -- fitting -------------------------------------------------------------------------------------
class PredictorFit:
    """Accumulates, per MoE layer, the normal equations of [rms(r), 1] @ B ~= true router logits,
    routing counts, and a held-out sample used to choose the ridge strength.

    map="mlp" or previous_token=True also keep the calibration rows (features, true logits,
    routing) for the MLP's training and hold out every holdout_sequences-th sequence (whole
    sequences: neighbouring tokens, which the previous-token input links, never straddle the split)."""

    def __init__(self, model, holdout_every: int = 10, holdout_max: int = 8192, map: str = "linear",
                 hidden: int = 64, previous_token: bool = False, epochs: int = 12, holdout_sequences: int = 8,
                 seed: int = 0, lr: float = 3e-3) -> None:
        from moekv.models.loader import moe_layers

        if map not in ("linear", "mlp"):
            raise ValueError(f"map={map!r}: expected 'linear' or 'mlp'")
        self.model = model
        self.layers = moe_layers(model)
        self.predictor = ExpertPredictor(model)  # pre-gating: the prior and the baseline
        self.holdout_every = holdout_every
        self.holdout_max = holdout_max
        self.map, self.hidden, self.previous_token, self.epochs, self.seed = map, hidden, previous_token, epochs, seed
        self.lr = lr
        self.keep_rows = map == "mlp" or previous_token
        self.holdout_sequences = holdout_sequences
        self.gram: dict[int, torch.Tensor] = {}
        self.cross: dict[int, torch.Tensor] = {}
        self.counts: dict[int, torch.Tensor] = {}
        self.held: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # (x, y) fit rows (keep_rows)
        self.sequences: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self._seen = 0

    @torch.no_grad()
    def add(self, layer_idx: int, residual: torch.Tensor, hidden: torch.Tensor, expert_ids: torch.Tensor,
            starts: torch.Tensor | None = None) -> None:
        """One batch of layer layer_idx: residual [T, H] entering the layer, the router's input
        hidden [T, H] and its decision expert_ids [T, k]; starts: bool [T], True at each sequence's
        first row in the batch (None: the batch is one sequence)."""
        moe = self.layers[layer_idx]
        y = F.linear(hidden.float(), moe.gate.float()).double().cpu()  # [T, E] the true logits
        ids = expert_ids.cpu()
        if self.keep_rows:
            residual = residual.float().cpu()
            starts = None if starts is None else starts.cpu()
            prev = previous_rows(residual, starts) if self.previous_token else None
            x = map_input(residual, prev, self.predictor.eps).double()
            if starts is None:
                starts = torch.zeros(x.shape[0], dtype=torch.bool)
                starts[0] = True
            seq = torch.cumsum(starts.long(), 0) - 1 + self.sequences.get(layer_idx, 0)
            self.sequences[layer_idx] = int(seq[-1]) + 1 if seq.numel() else self.sequences.get(layer_idx, 0)
            held = seq % self.holdout_sequences == self.holdout_sequences - 1
            self.held.setdefault(layer_idx, []).append((x[held].float(), ids[held]))
            self.rows.setdefault(layer_idx, []).append((x[~held].float(), y[~held].float()))
        else:
            x = rms(residual, self.predictor.eps).double().cpu()
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)  # [T, H + 1]
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
        """The pre-gating map as a [I + 1, E] matrix: diag(norm weight) @ gate^T, no bias (and
        zeros for the previous token's rows)."""
        moe = self.layers[layer_idx]
        w = self.model.layers[layer_idx].post_attention_layernorm.weight.detach().double().cpu()
        gate = moe.gate.detach().double().cpu()
        rows = [w[:, None] * gate.T]
        if self.previous_token:
            rows.append(torch.zeros_like(rows[0]))
        return torch.cat(rows + [torch.zeros(1, gate.shape[0], dtype=torch.float64)])

    def solve(self, layer_idx: int, alpha: float) -> torch.Tensor:
        """argmin ||X B - Y||^2 + lam ||B - prior||^2, lam = alpha x mean diagonal of X^T X."""
        g, c, b0 = self.gram[layer_idx], self.cross[layer_idx], self.prior(layer_idx)
        lam = alpha * float(g.diagonal().mean())
        eye = torch.eye(g.shape[0], dtype=g.dtype)
        return torch.linalg.solve(g + lam * eye, c + lam * b0)

    def _held(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        parts = self.held.get(layer_idx, [])
        if not parts or not sum(a.shape[0] for a, _ in parts):
            return None
        return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])

    def held_recall(self, layer_idx: int, weight: torch.Tensor, up: torch.Tensor | None = None,
                    down: torch.Tensor | None = None) -> float:
        held = self._held(layer_idx)
        if held is None:
            return float("nan")
        x, ids = held
        k = ids.shape[1]
        logits = map_logits(x.to(weight.dtype), weight, None if up is None else up.to(weight.dtype),
                            None if down is None else down.to(weight.dtype))
        scores = self.predictor._rank_scores(layer_idx, logits.float())
        return float(recall(scores.topk(k, -1).indices, ids).mean())

    def train_mlp(self, layer_idx: int, weight0: torch.Tensor, batch: int = 512):
        """x @ B + gelu(x @ U) @ V trained to the true router's softmax (KL; sigmoid routers: binary
        cross-entropy of each expert's score) from B = weight0, V = 0 (so it starts at weight0's
        map); AdamW, one-cycle schedule; the epoch with the best held-out recall is kept.
        Returns (held-out recall, B, U, V, epoch)."""
        x = torch.cat([a for a, _ in self.rows[layer_idx]])
        y = torch.cat([b for _, b in self.rows[layer_idx]])
        gen = torch.Generator().manual_seed(self.seed + layer_idx)
        fan_in = x.shape[1]
        B = weight0.float().clone().requires_grad_()
        U = ((torch.rand(fan_in, self.hidden, generator=gen) * 2 - 1) / fan_in ** 0.5).requires_grad_()
        V = torch.zeros(self.hidden, y.shape[1], requires_grad=True)
        lr = self.lr
        opt = torch.optim.AdamW([B, U, V], lr=lr, weight_decay=0.0)
        steps_per_epoch = max(1, x.shape[0] // batch)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=self.epochs * steps_per_epoch, pct_start=0.1)
        best = (self.held_recall(layer_idx, weight0.float()), weight0.float(), None, None, -1)
        for epoch in range(self.epochs):
            perm = torch.randperm(x.shape[0], generator=gen)
            for b in range(steps_per_epoch):
                idx = perm[b * batch:(b + 1) * batch]
                out = map_logits(x[idx], B, U, V)
                if self.predictor.sigmoid:
                    loss = F.binary_cross_entropy_with_logits(out, torch.sigmoid(y[idx]))
                else:
                    loss = F.kl_div(F.log_softmax(out, -1), F.log_softmax(y[idx], -1), log_target=True,
                                    reduction="batchmean")
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
            with torch.no_grad():
                r = self.held_recall(layer_idx, B.detach(), U.detach(), V.detach())
            if r > best[0] + 1e-9:
                best = (r, B.detach().clone(), U.detach().clone(), V.detach().clone(), epoch)
        return best

    def finish(self, alphas=DEFAULT_ALPHAS, meta: dict | None = None) -> tuple[ExpertPredictor, dict]:
        """The fitted predictor (ridge strength per layer chosen on the held-out tokens; with
        map="mlp", the MLP trained from that ridge map, kept if it beats it on them) and a summary:
        per layer, held-out recall of pre-gating and of the fit at each strength."""
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
            summary[i] = {"tokens": self.tokens[i], "holdout_recall_pregate": pre, "holdout_recall_fitted": r,
                          "alpha": alpha, "holdout_recall_by_alpha": tried}
            up = down = None
            if self.map == "mlp":
                with torch.enable_grad():
                    r_mlp, w_mlp, up, down, epoch = self.train_mlp(i, w)
                summary[i].update(holdout_recall_linear=r, holdout_recall_fitted=r_mlp, epoch=epoch)
                w = w_mlp
            fitted[i] = FittedLayer(w.float(), self.counts[i].float(), probe, alpha, up, down, self.previous_token)
        meta = {**(meta or {}), "map": self.map, "previous_token": self.previous_token}
        if self.map == "mlp":
            meta.update(hidden=self.hidden, epochs=self.epochs)
        return ExpertPredictor(self.model, fitted, source="fitted", meta=meta), summary
