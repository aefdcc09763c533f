"""`moekv calibrate-experts`: fit the expert predictor's per-layer linear maps (and record routing
frequencies) on calibration text; `moekv eval experts` measures prediction recall on a text."""
from __future__ import annotations

from pathlib import Path

import torch

from moekv.eval.perplexity import read_text_tokens
from moekv.experts.observe import observed, sequence_starts
from moekv.experts.predictor import DEFAULT_ALPHAS, ExpertPredictor, PredictorFit, previous_rows, recall


def run_windows(llm, token_ids: list[int], window: int, progress: bool = True, batch_windows: int = 8,
                desc: str = "tokens") -> None:
    """token_ids through the model in non-overlapping prefill windows (whatever observes it sees them)."""
    from tqdm.auto import tqdm

    chunks = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    chunks = [c for c in chunks if c]
    bar = tqdm(total=len(token_ids), desc=desc, unit="tok", disable=not progress)
    for i in range(0, len(chunks), batch_windows):
        group = chunks[i:i + batch_windows]
        llm.score([{"prompt_token_ids": c} for c in group])
        bar.update(sum(len(c) for c in group))
    bar.close()


def calibration_tokens(tokenizer, paths: list[str | Path], max_tokens: int) -> list[int]:
    """The first max_tokens / n tokens of each of the n files."""
    ids: list[int] = []
    for path in paths:
        ids += read_text_tokens(tokenizer, path, max_tokens // len(paths))
    return ids


@torch.no_grad()
def calibrate_experts(llm, paths: list[str | Path], max_tokens: int = 65536, window: int | None = None,
                      alphas=DEFAULT_ALPHAS, progress: bool = True, map: str = "linear", hidden: int = 64,
                      previous_token: bool = False, epochs: int = 12) -> tuple[ExpertPredictor, dict]:
    """Fit one map per MoE layer on the model's own routing of the calibration text: linear
    ([H + 1, E], ridge toward pre-gating, strength chosen on every 10th token held out) or, with
    map="mlp" / previous_token, see PredictorFit (every 8th window held out)."""
    if not paths:
        raise ValueError("calibrate-experts needs at least one --text file")
    model = llm.engine.runner.model
    window = window or llm.engine.max_model_len
    ids = calibration_tokens(llm.tokenizer, paths, max_tokens)
    fit = PredictorFit(model, map=map, hidden=hidden, previous_token=previous_token, epochs=epochs)

    def on_layer(layer_idx, residual, hidden, weights, expert_ids):
        starts = sequence_starts(obs.ctx, residual.shape[0]) if fit.keep_rows else None
        fit.add(layer_idx, residual, hidden, expert_ids, starts)

    with observed(model, on_layer) as obs:
        run_windows(llm, ids, window, progress, desc="calibration")
    meta = {"texts": [str(p) for p in paths], "tokens": len(ids), "window": window}
    predictor, summary = fit.finish(alphas, meta)
    return predictor, {"tokens": len(ids), "window": window, "layers": summary}


class _Recall:
    def __init__(self) -> None:
        self.tokens = 0
        self.sums: dict[str, float] = {}

    def add(self, name: str, values: torch.Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(values.sum())

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        return {"tokens": self.tokens, **{name: s / n for name, s in self.sums.items()}}


@torch.no_grad()
def evaluate_expert_prediction(llm, text: str | Path, predictor: ExpertPredictor | str | Path | None = None,
                               max_tokens: int | None = 16384, window: int | None = None,
                               progress: bool = True) -> dict:
    """Per MoE layer, over the tokens of `text` (prefill windows): the share of each token's true
    top-k experts found among the predicted top-k (`recall_pregate`, `recall_fitted`) and among the
    predicted top-2k (`..._at_2k`: a prefetch of twice the experts), and, with a fitted file, among
    the k experts most often routed to on its calibration text (`recall_static_hot`: a fixed hot set)."""
    model = llm.engine.runner.model
    cfg = llm.engine.model_config
    k = cfg.top_k
    pregate = ExpertPredictor(model)
    if predictor is not None and not isinstance(predictor, ExpertPredictor):
        predictor = ExpertPredictor.load(predictor, model)
    window = window or llm.engine.max_model_len
    ids = read_text_tokens(llm.tokenizer, text, max_tokens)
    stats: dict[int, _Recall] = {}

    def on_layer(layer_idx, residual, hidden, weights, expert_ids):
        st = stats.setdefault(layer_idx, _Recall())
        st.tokens += expert_ids.shape[0]
        ranked = pregate.scores(layer_idx, residual).argsort(-1, descending=True)
        st.add("recall_pregate", recall(ranked[:, :k], expert_ids))
        st.add("recall_pregate_at_2k", recall(ranked[:, :2 * k], expert_ids))
        if predictor is not None:
            prev = None
            if predictor.needs_previous:  # each window's previous rows (zeros at its first token)
                prev = previous_rows(residual, sequence_starts(obs.ctx, residual.shape[0], residual.device))
            ranked = predictor.scores(layer_idx, residual, previous=prev).argsort(-1, descending=True)
            st.add("recall_fitted", recall(ranked[:, :k], expert_ids))
            st.add("recall_fitted_at_2k", recall(ranked[:, :2 * k], expert_ids))
            freq = predictor.frequency(layer_idx)
            hot = freq.topk(k).indices.to(expert_ids.device).expand(expert_ids.shape[0], k)
            st.add("recall_static_hot", recall(hot, expert_ids))

    with observed(model, on_layer) as obs:
        run_windows(llm, ids, window, progress, desc="evaluation")
    per_layer = {str(i): s.summary() for i, s in sorted(stats.items())}
    keys = [key for key in next(iter(per_layer.values())) if key.startswith("recall")]
    total = sum(s["tokens"] for s in per_layer.values())
    later = [s for i, s in per_layer.items() if int(i) != min(stats)]
    record = {
        "text": str(text), "tokens": len(ids), "window": window, "top_k": k, "num_experts": cfg.num_experts,
        "predictor": None if predictor is None else predictor.source,
        "expert_bytes": expert_bytes(model),
        "mean": {key: sum(s[key] * s["tokens"] for s in per_layer.values()) / total for key in keys},
        "min_after_first_layer": {key: min(s[key] for s in later) for key in keys} if later else {},
        "per_layer": per_layer,
    }
    return record


def expert_bytes(model) -> int:
    """Bytes of one expert's weights (w13 and w2) in the model's dtype: what one miss copies."""
    from moekv.experts.offload import expert_nbytes
    from moekv.models.loader import moe_layers

    return expert_nbytes(next(iter(moe_layers(model).values())))
