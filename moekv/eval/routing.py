"""Routing quality and locality (`moekv eval routing`).

One perplexity pass through the engine with the router under test, with every MoE layer tapped:
on the very input each layer receives, the tap also computes the model's own flat routing and both
layers' outputs, so that each layer's agreement and output error against flat are measured where
the run actually is (without compounding earlier layers' differences into the comparison). The
decisions of both routers are scored under the clustered placement (when a cluster map is given)
and under random placements. An engine with expert parallelism also reports, per layer, the bytes
its ranks really sent per token beside the figure its placement predicts (`placements["engine"]`);
the per-layer output error is not measured there (a rank holds only its share of the experts).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from moekv.models.loader import moe_layers
from moekv.ops.reference import cluster_routing_ref, fused_moe_ref
from moekv.routing import checkpoint_router
from moekv.routing.placement import Placement, PlacementStats
from moekv.routing.tap import tapped


class _LayerStats:
    def __init__(self) -> None:
        self.tokens = self.same_set = self.same_top1 = 0
        self.err_sq = self.ref_sq = 0.0
        self.clusters = 0.0

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        return {"tokens": self.tokens, "topk_set_agreement": self.same_set / n, "top1_agreement": self.same_top1 / n,
                "relative_error": math.sqrt(self.err_sq / max(self.ref_sq, 1e-30)),
                "clusters_per_token": self.clusters / n}


def evaluate_routing(llm, text: str | Path, max_tokens: int | None = 16384, window: int | None = None,
                     stride: int | None = None, mode: str = "prefill", cluster_map=None, num_devices: int | None = None,
                     random_seeds: int = 4, progress: bool = True) -> dict:
    """Perplexity of `text` through llm with its installed routers, plus agreement, per-layer output
    error, locality and fan-out against the model's flat routing. cluster_map: a ClusterMap or path
    (defines the clustered placement; llm's own map is used when it routes hierarchically)."""
    from moekv.eval.perplexity import perplexity
    from moekv.routing.cluster_map import ClusterMap
    from moekv.routing.hierarchical import HierarchicalRouter, router_flops_per_token

    engine = llm.engine
    cfg = engine.model_config
    model = engine.runner.model
    layers = moe_layers(model)
    if cluster_map is None and engine.config.router.cluster_map is not None:
        cluster_map = engine.config.router.cluster_map
    if cluster_map is not None and not isinstance(cluster_map, ClusterMap):
        cluster_map = ClusterMap.load(cluster_map)
    if cluster_map is not None:
        cluster_map.check_model(cfg, {i: moe.gate for i, moe in layers.items()})
    runner = engine.runner
    parallel = getattr(runner, "parallel", None) is not None
    engine_placement = getattr(runner, "expert_placement", None)
    if engine_placement is not None:  # the ranks the experts really live on
        num_devices = num_devices or runner.parallel.world_size
    num_devices = num_devices or (cluster_map.num_clusters if cluster_map is not None else min(4, cfg.num_experts))
    placements = {}
    if engine_placement is not None:
        placements["engine"] = Placement(engine_placement, runner.parallel.world_size, "engine")
    if cluster_map is not None:
        placements["clustered"] = Placement.from_clusters(cluster_map, num_devices)
    first = next(iter(layers.values())).hooks.router
    n_group = getattr(first, "n_group", 1)
    if n_group > 1:  # group-limited routing: group g on device g mod D (groups are contiguous experts)
        per_group = cfg.num_experts // n_group
        placements["grouped"] = Placement({i: torch.arange(cfg.num_experts) // per_group % num_devices for i in layers},
                                          num_devices, "grouped")
    for seed in range(random_seeds):
        placements[f"random{seed}"] = Placement.random(list(layers), cfg.num_experts, num_devices, seed)
    stats_under = {name: PlacementStats(p) for name, p in placements.items()}
    flat_under = {name: PlacementStats(p) for name, p in placements.items()}
    per_layer = {i: _LayerStats() for i in layers}
    flat_routers = {i: checkpoint_router(cfg) for i in layers}
    router_name = first.__class__.__name__

    @torch.no_grad()
    def compare(layer_idx, hidden, router_logits, weights, ids):
        moe = layers[layer_idx]
        flat_w, flat_ids = flat_routers[layer_idx](hidden, F.linear(hidden, moe.gate))  # never touches router_logits
        st = per_layer[layer_idx]
        st.tokens += ids.shape[0]
        st.same_set += int((ids.sort(1).values == flat_ids.sort(1).values).all(1).sum())
        st.same_top1 += int((ids[:, 0] == flat_ids[:, 0]).sum())
        if not parallel:  # (a rank of a parallel engine holds only its share of the experts)
            ours = fused_moe_ref(hidden, moe.w13, moe.w2, weights, ids).float()
            ref = fused_moe_ref(hidden, moe.w13, moe.w2, flat_w, flat_ids).float()
            if moe.shared_expert is not None:  # the layer's output includes its shared expert (same in both)
                shared = moe.shared_output(hidden).float()
                ours, ref = ours + shared, ref + shared
            st.err_sq += float((ours - ref).pow(2).sum())
            st.ref_sq += float(ref.pow(2).sum())
        inner = moe.hooks.router.inner
        if isinstance(inner, HierarchicalRouter) and router_logits.cluster_scores is not None:
            kept = cluster_routing_ref(hidden, router_logits.cluster_scores, inner.gate_by_cluster,
                                       inner.cluster_experts, inner.top_k, inner.renormalize, inner.clusters_per_token,
                                       inner.admit_margin, return_kept=True)[2]
            st.clusters += float((kept >= 0).sum())
        else:
            st.clusters += ids.shape[0] * (cluster_map.num_clusters if cluster_map is not None else 1)
        for name in placements:
            stats_under[name].add(layer_idx, ids.cpu())
            flat_under[name].add(layer_idx, flat_ids.cpu())

    ep_before = runner.expert_parallel_bytes() if parallel else None
    with tapped(layers, compare):
        result = perplexity(llm, text, window=window, stride=stride, max_tokens=max_tokens, progress=progress,
                            mode=mode)
    ep_after = runner.expert_parallel_bytes() if parallel else None

    def placement_summary(stats: dict[str, PlacementStats]) -> dict:
        out = {}
        bpe = torch.finfo(engine.runner.dtype).bits // 8
        for name in ("engine", "grouped", "clustered"):
            if name in stats:
                out[name] = stats[name].summary(cfg.hidden_size, bpe)
        randoms = [s.summary(cfg.hidden_size, bpe) for name, s in stats.items() if name.startswith("random")]
        if randoms:
            out["random"] = {key: sum(r[key] for r in randoms) / len(randoms)
                             for key in ("locality", "fan_out", "cross_device_bytes_per_token")}
            out["random"].update(placement=f"random (mean of {len(randoms)} seeds)", num_devices=num_devices)
        return out

    layer_summaries = {i: s.summary() for i, s in per_layer.items()}
    total = sum(s.tokens for s in per_layer.values())
    ours, flat = placement_summary(stats_under), placement_summary(flat_under)
    main = ours.get("engine", ours.get("grouped", ours.get("clustered", ours.get("random"))))
    record = {
        "routing": engine.runner.routing,
        "router": router_name,
        "ppl": result.ppl,
        "nll": result.nll,
        "tokens": result.tokens,
        "text": str(text),
        "mode": mode,
        "locality": main["locality"],
        "fan_out": main["fan_out"],
        "cross_device_bytes_per_token": main["cross_device_bytes_per_token"],
        "placement": main["placement"],
        "topk_agreement": {"set": sum(s.same_set for s in per_layer.values()) / total,
                           "top1": sum(s.same_top1 for s in per_layer.values()) / total},
        "relative_error": {str(i): s["relative_error"] for i, s in layer_summaries.items()},
        "per_layer": {str(i): {**s, **{f"{p}_locality": ours[p]["per_layer"][i]["locality"] for p in ours
                                        if "per_layer" in ours[p]}} for i, s in layer_summaries.items()},
        "placements": ours,
        "flat_placements": flat,
    }
    if parallel:
        for s in record["per_layer"].values():
            s["relative_error"] = None
        record["relative_error"] = {str(i): None for i in layer_summaries}
    if ep_after is not None:  # bytes the ranks really sent per token, beside what the placement predicts
        for i, s in layer_summaries.items():
            sent = (ep_after[i][0] - ep_before[i][0]) / max(s["tokens"], 1)
            record["per_layer"][str(i)]["ep_bytes_per_token"] = sent
            record["per_layer"][str(i)]["simulated_bytes_per_token"] = \
                ours["engine"]["per_layer"][i]["cross_device_bytes_per_token"]
        record["ep_bytes_per_token"] = sum(p["ep_bytes_per_token"] for p in record["per_layer"].values())
    if cluster_map is not None:
        mean_clusters = sum(s.clusters for s in per_layer.values()) / total
        record["clusters_per_token"] = mean_clusters
        if engine.runner.routing == "hierarchical":
            record["router_flops_per_token"] = router_flops_per_token(cfg.hidden_size, cfg.num_experts,
                                                                      cluster_map.num_clusters, mean_clusters)
    return record
