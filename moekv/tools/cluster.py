"""`moekv cluster`: run calibration text through an LLM and cluster every MoE layer's experts into
a ClusterMap (routing/cluster.py has the arithmetic of one layer, routing/cluster_map.py the file).

A tool above the engine: it drives an LLM (scores windows of text with a RouterTap on every MoE
layer to collect the router's inputs, then measures each layer's admission margins by perplexity).
"""
from __future__ import annotations

import math

import torch

from moekv.eval.perplexity import read_text_tokens, score_windows
from moekv.models.loader import moe_layers
from moekv.routing.cluster import MARGINS, ClusterWeights, choose_margins, cluster_layer, margin_locality
from moekv.routing.cluster_map import ClusterMap
from moekv.routing.hierarchical import HierarchicalRouter
from moekv.routing.tap import tapped


def split_calibration(tokenizer, paths: list[str], max_tokens: int, quality_tokens: int) -> tuple[list[int], list[int]]:
    """From each file, its first max_tokens / n tokens for clustering, the next quality_tokens / n for
    the margin sensitivity (disjoint, so the margins are not fitted on the clustering tokens)."""
    cluster_ids, quality_ids = [], []
    per_file, per_file_q = max_tokens // len(paths), quality_tokens // len(paths)
    for path in paths:
        ids = read_text_tokens(tokenizer, path, per_file + per_file_q)
        cluster_ids += ids[:per_file]
        quality_ids += ids[per_file:per_file + per_file_q]
    return cluster_ids, quality_ids


@torch.no_grad()
def collect_router_inputs(llm, token_ids: list[int], window: int, progress: bool = True,
                          batch_windows: int = 8) -> dict[int, torch.Tensor]:
    """Run token_ids through the model in non-overlapping windows with its own routing; returns
    MoE layer -> the router's inputs [N, H] (fp32, CPU)."""
    from tqdm.auto import tqdm

    store: dict[int, list[torch.Tensor]] = {}

    def keep(layer_idx, hidden, router_logits, weights, ids):
        store.setdefault(layer_idx, []).append(hidden.detach().float().cpu())

    chunks = [token_ids[i:i + window] for i in range(0, len(token_ids), window)]
    bar = tqdm(total=len(token_ids), desc="calibration", unit="tok", disable=not progress)
    with tapped(moe_layers(llm.engine.runner.model), keep):
        for i in range(0, len(chunks), batch_windows):
            group = chunks[i:i + batch_windows]
            llm.score([{"prompt_token_ids": c} for c in group])
            bar.update(sum(len(c) for c in group))
    bar.close()
    return {idx: torch.cat(parts) for idx, parts in store.items()}


def windowed_nll(llm, token_ids: list[int], window: int, batch_windows: int = 8) -> float:
    """Mean NLL of token_ids scored in non-overlapping windows through llm as it is routed now."""
    def logits_fn(chunks, first_rows, advance):  # progress=False: no bar to advance
        return llm.score([{"prompt_token_ids": c} for c in chunks])

    total, count = score_windows(logits_fn, token_ids, window, window, progress=False, batch_windows=batch_windows)
    return total / count


def build_cluster_map(llm, token_ids: list[int], num_clusters: int, quality_ids: list[int] | None = None,
                      ppl_budget: float = 0.01, clusters_per_token: int = 0, window: int | None = None,
                      margins: tuple[float, ...] = MARGINS, weights: ClusterWeights = ClusterWeights(),
                      restarts: int = 16, seed: int = 0, progress: bool = True):
    """Cluster every MoE layer of llm's model; returns (ClusterMap, summary).

    token_ids: calibration tokens for co-activation counts and the coarse gates. quality_ids: other
    calibration tokens on which, for each layer alone and each margin, the increase of NLL over flat
    routing is measured; the per-layer margins then maximise locality within ppl_budget (relative
    perplexity increase, e.g. 0.01). Without quality_ids every layer keeps all clusters (margin inf)."""
    from tqdm.auto import tqdm

    cfg = llm.engine.model_config
    window = min(window or llm.engine.max_model_len, llm.engine.max_model_len)
    hidden = collect_router_inputs(llm, token_ids, window, progress)
    moes = moe_layers(llm.engine.runner.model)
    per_token = min(clusters_per_token or num_clusters, num_clusters)
    layers, stats, table = {}, {}, {}
    for idx, moe in tqdm(moes.items(), desc="clustering", unit="layer", disable=not progress):
        bias = None if moe.e_score_correction_bias is None else moe.e_score_correction_bias.detach().float().cpu()
        gate = moe.gate.detach().float().cpu()
        layers[idx], stats[idx] = cluster_layer(hidden[idx], gate, moe.w13.detach().float().cpu(),
                                                moe.w2.detach().float().cpu(), num_clusters, cfg.top_k,
                                                cfg.norm_topk_prob, cfg.scoring_func, bias, weights, restarts, seed)
        table[idx] = [{"margin": m, **margin_locality(hidden[idx], gate, layers[idx], cfg.top_k, cfg.norm_topk_prob,
                                                      per_token, m, cfg.scoring_func, bias), "delta_nll": 0.0}
                      for m in margins]
    if quality_ids:
        base = windowed_nll(llm, quality_ids, window)
        jobs = [(i, row) for i in table for row in table[i] if row["margin"] != float("inf")]
        for i, row in tqdm(jobs, desc="margin sensitivity", unit="run", disable=not progress):
            flat_router = moes[i].hooks.router
            moes[i].hooks.router = HierarchicalRouter(layers[i], moes[i].gate, cfg.top_k, cfg.norm_topk_prob, per_token,
                                                row["margin"], cfg.scoring_func, cfg.routed_scaling_factor)
            try:
                row["delta_nll"] = windowed_nll(llm, quality_ids, window) - base
            finally:
                moes[i].hooks.router = flat_router
        chosen = choose_margins(table, ppl_budget)
    else:
        chosen = {i: float("inf") for i in table}
    for i, margin in chosen.items():
        layers[i].admit_margin = margin
        row = next(r for r in table[i] if r["margin"] == margin)
        stats[i].update({"admit_margin": margin, **{f"hier_{k}": v for k, v in row.items() if k != "margin"}})
    summary = {"tokens": len(token_ids), "quality_tokens": len(quality_ids or []), "ppl_budget": ppl_budget,
               "expected_ppl_change": math.expm1(sum(stats[i]["hier_delta_nll"] for i in stats)),
               "expected_locality": sum(stats[i]["hier_locality"] for i in stats) / len(stats),
               "layers": {str(i): s for i, s in stats.items()},
               "margin_table": {str(i): rows for i, rows in table.items()}, "weights": vars(weights)}
    cmap = ClusterMap(cfg.architecture, cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.top_k, layers,
                      clusters_per_token=per_token, summary=summary)
    return cmap, summary
