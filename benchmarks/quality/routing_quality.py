#!/usr/bin/env python3
"""Hierarchical routing on the tiny model: locality against perplexity change (CPU).

1. `moekv cluster` logic on calibration books (the first 8k tokens of each of the four training
   books for clustering, the next 2k of each for the per-layer margins), C = 4 clusters, default
   budget +1% perplexity on the calibration text -> cluster map.
2. `moekv eval routing` logic on WikiText-2 test (16k tokens, prefill windows of 512, stride 256)
   for: flat (under random and clustered placement), hierarchical with the map's default margins,
   hierarchical with one margin for all layers (a sweep), hierarchical with per-layer margins chosen
   for other budgets, group-limited routing over the learned clusters (exact cluster choice from
   the full logits, DeepSeek-V3's rule) and over contiguous groups.
3. JSON, a markdown table on stdout and a plot under benchmarks/results/cpu/.

    OMP_NUM_THREADS=1 python benchmarks/quality/routing_quality.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from result_paths import repo_path, repo_relative  # noqa: E402

from moekv import LLM  # noqa: E402
from moekv.cli.eval import _finite  # noqa: E402
from moekv.config import default_model_path  # noqa: E402
from moekv.eval.routing import evaluate_routing  # noqa: E402
from moekv.models.loader import moe_layers  # noqa: E402
from moekv.ops.reference import fused_routing_ref  # noqa: E402
from moekv.routing.cluster import choose_margins  # noqa: E402
from moekv.routing.cluster_map import ClusterMap  # noqa: E402
from moekv.routing.hierarchical import router_flops_per_token  # noqa: E402
from moekv.routing.logits import RouterLogits  # noqa: E402
from moekv.tools.cluster import build_cluster_map, split_calibration  # noqa: E402

TEXT_DIR = REPO.parent / "shared" / "data" / "text"
BOOKS = ["pg1399.txt", "pg2554.txt", "pg2600.txt", "tinyshakespeare.txt"]
OUT_DIR = REPO / "benchmarks" / "results" / "cpu"
UNIFORM_MARGINS = [-math.inf, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1.5, math.inf]
BUDGETS = [0.0025, 0.005, 0.02, 0.04, 0.08, 0.16, 0.32]
HELD_OUT_LABELS = ("flat", "default", "budget 0.08", "budget 0.16", "uniform -0.25", "uniform -inf")


class ClusterGroupRouter:
    """DeepSeek-V3's group rule over the learned clusters: the full [T, E] logits, groups = clusters,
    one group kept. An exact cluster choice (no coarse gate, no FLOP saving): the quality bound of
    routing inside one cluster."""
    name = "group_limited_on_clusters"

    def __init__(self, experts: torch.Tensor, top_k: int, renormalize: bool, topk_group: int = 1) -> None:
        self.order = experts.flatten()  # position -> expert
        self.C = experts.shape[0]
        self.top_k, self.renormalize, self.topk_group = top_k, renormalize, topk_group

    def norm_and_coarse(self, x, norm):
        return norm(x), None

    def __call__(self, hidden, router_logits):
        logits = RouterLogits.of(router_logits).full()[:, self.order]
        w, pos = fused_routing_ref(logits, self.top_k, self.renormalize, "softmax", None, self.C, self.topk_group)
        return w, self.order[pos]


def evaluate(label: str, text: Path, args, kind: str, **llm_kwargs) -> dict:
    start = time.perf_counter()
    install = llm_kwargs.pop("install", None)
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, max_num_batched_tokens=4096, **llm_kwargs)
    if install is not None:
        for i, moe in moe_layers(llm.engine.runner.model).items():
            moe.hooks.router = install(i, moe)
    rec = evaluate_routing(llm, text, max_tokens=args.max_tokens, mode="prefill",
                           cluster_map=llm_kwargs.get("cluster_map") or args.map_path, progress=False)
    rec.update(label=label, kind=kind, seconds=time.perf_counter() - start,
               llm_kwargs={k: str(v) if isinstance(v, Path) else v for k, v in llm_kwargs.items()})
    print(f"  {label:<44} ppl {rec['ppl']:9.3f}  locality {rec['locality']:.3f}  fan-out {rec['fan_out']:.2f}  "
          f"clusters/tok {rec.get('clusters_per_token', float('nan')):.2f}  ({rec['seconds']:.0f} s)", flush=True)
    return rec


def with_margins(cmap: ClusterMap, margins: dict[int, float], path: Path) -> Path:
    for i, m in margins.items():
        cmap.layers[i].admit_margin = m
    return cmap.save(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16384, help="WikiText-2 tokens to evaluate on")
    p.add_argument("--cluster-tokens", type=int, default=32768)
    p.add_argument("--quality-tokens", type=int, default=8192)
    p.add_argument("--ppl-budget", type=float, default=0.01)
    p.add_argument("--out", type=Path, default=OUT_DIR / "routing_quality_tiny-moe.json")
    p.add_argument("--map-out", type=Path, default=OUT_DIR / "tiny-moe.clusters4.safetensors")
    p.add_argument("--replot", action="store_true", help="only redraw the plot and tables from --out")
    args = p.parse_args()
    if args.replot:
        result = json.loads(args.out.read_text())
        print_table(result)
        print_held_out(result)
        plot(result, args.out.with_suffix(".png"))
        return
    wikitext = TEXT_DIR / "wikitext2_test.txt"
    t0 = time.perf_counter()

    print(f"clustering on {', '.join(BOOKS)}")
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, max_num_batched_tokens=4096, routing="flat")
    cluster_ids, quality_ids = split_calibration(llm.tokenizer, [TEXT_DIR / b for b in BOOKS], args.cluster_tokens,
                                                 args.quality_tokens)
    cmap, summary = build_cluster_map(llm, cluster_ids, args.clusters, quality_ids=quality_ids,
                                      ppl_budget=args.ppl_budget, progress=False)
    args.map_path = cmap.save(args.map_out)
    cluster_seconds = time.perf_counter() - t0
    print(f"  map {args.map_path} in {cluster_seconds:.0f} s; per-layer margins "
          f"{[cmap.layers[i].admit_margin for i in sorted(cmap.layers)]}")
    cfg = llm.engine.model_config
    del llm

    rows = []
    print(f"evaluating on {wikitext.name} ({args.max_tokens} tokens)")
    rows.append(evaluate("flat", wikitext, args, "flat", routing="flat") | {"tag": "flat"})
    rows.append(evaluate("hierarchical (default: per-layer margins, +1% budget)", wikitext, args, "default",
                         routing="hierarchical", cluster_map=args.map_path) | {"tag": "default"})
    table = {int(i): rows_ for i, rows_ in summary["margin_table"].items()}
    with tempfile.TemporaryDirectory() as tmp:
        for budget in BUDGETS:
            margins = choose_margins(table, budget)
            path = with_margins(ClusterMap.load(args.map_path), margins, Path(tmp) / f"b{budget}.safetensors")
            rec = evaluate(f"hierarchical, per-layer margins, budget +{100 * budget:g}%", wikitext, args, "budget",
                           routing="hierarchical", cluster_map=path)
            rec.update(ppl_budget=budget, margins={str(i): m for i, m in margins.items()}, tag=f"budget {budget:g}")
            rows.append(rec)
    for margin in UNIFORM_MARGINS:
        rec = evaluate(f"hierarchical, margin {margin:g} in every layer", wikitext, args, "uniform",
                       routing="hierarchical", cluster_map=args.map_path, cluster_admit_margin=margin)
        rec.update(margin=margin, tag=f"uniform {margin:g}")
        rows.append(rec)
    experts = {i: cmap.layers[i].experts for i in cmap.layers}
    rows.append(evaluate("group-limited over the clusters (exact, 1 of 4)", wikitext, args, "cluster_groups",
                         routing="flat", install=lambda i, moe: ClusterGroupRouter(experts[i], cfg.top_k,
                                                                                     cfg.norm_topk_prob)))
    for topk_group in (1, 2):
        rows.append(evaluate(f"group-limited, 4 contiguous groups, keep {topk_group}", wikitext, args, "group_limited",
                             routing="group_limited", n_group=4, topk_group=topk_group))

    flat = rows[0]
    for r in rows:
        r["ppl_change"] = r["ppl"] / flat["ppl"] - 1

    # the same configurations on in-domain text: the held-out 5% of the training books
    held_out_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        held = Path(tmp) / "heldout_books.txt"
        subprocess.run([sys.executable, str(REPO / "scripts" / "export_heldout.py"), "--out", str(held)], check=True,
                       capture_output=True)
        print(f"evaluating on the held-out books ({args.max_tokens} tokens)")
        for r in rows:
            if r.get("tag") in HELD_OUT_LABELS:
                kwargs = dict(r["llm_kwargs"])
                if "margins" in r:
                    kwargs["cluster_map"] = with_margins(ClusterMap.load(args.map_path),
                                                         {int(i): m for i, m in r["margins"].items()},
                                                         Path(tmp) / "m.safetensors")
                rec = evaluate(r["label"], held, args, r["kind"], **kwargs)
                held_out_rows.append(rec)
    for r in held_out_rows:
        r["ppl_change"] = r["ppl"] / held_out_rows[0]["ppl"] - 1
    mean_clusters = rows[1].get("clusters_per_token", float("nan"))
    result = {
        "model": repo_path(args.model), "text": str(wikitext), "tokens": flat["tokens"], "clusters": args.clusters,
        "calibration": {"books": BOOKS, "cluster_tokens": len(cluster_ids), "quality_tokens": len(quality_ids),
                        "ppl_budget": args.ppl_budget, "seconds": cluster_seconds,
                        "expected_locality": summary["expected_locality"],
                        "expected_ppl_change": summary["expected_ppl_change"], "layers": summary["layers"],
                        "margin_table": summary["margin_table"]},
        "reference_points": {"flat_random_placement": flat["flat_placements"]["random"],
                             "flat_clustered_placement": flat["flat_placements"]["clustered"]},
        "router_flops_default": router_flops_per_token(cfg.hidden_size, cfg.num_experts, args.clusters, mean_clusters),
        "device": f"cpu ({platform.processor() or platform.machine()}), OMP_NUM_THREADS=1",
        "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "rows": rows,
        "held_out_books": {"text": "held-out 5% of the four training books (scripts/export_heldout.py)",
                           "rows": held_out_rows},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_finite(repo_relative(result)), indent=1) + "\n")
    print_table(result)
    print_held_out(result)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s)")


def print_table(result: dict) -> None:
    ref = result["reference_points"]
    print("\n| routing | locality | fan-out | cross-device bytes/token | clusters/token | router FLOPs saved | "
          "top-k sets = flat | ppl | ppl change |")
    print("|---|---|---|---|---|---|---|---|---|")
    flat = result["rows"][0]
    print(f"| flat, random placement | {ref['flat_random_placement']['locality']:.3f} | "
          f"{ref['flat_random_placement']['fan_out']:.2f} | "
          f"{ref['flat_random_placement']['cross_device_bytes_per_token']:,.0f} | - | 0% | 1.000 | {flat['ppl']:.2f} | "
          f"+0.00% |")
    for r in result["rows"]:
        label = "flat, clustered placement" if r["kind"] == "flat" else r["label"]
        flops = r.get("router_flops_per_token")
        saved = f"{100 * flops['saving']:+.1f}%" if flops else "0%"
        clusters = f"{r['clusters_per_token']:.2f}" if r["kind"] in ("default", "budget", "uniform") else "-"
        print(f"| {label} | {r['locality']:.3f} | {r['fan_out']:.2f} | {r['cross_device_bytes_per_token']:,.0f} | "
              f"{clusters} | {saved} | {r['topk_agreement']['set']:.3f} | {r['ppl']:.2f} | "
              f"{100 * r['ppl_change']:+.2f}% |")


def print_held_out(result: dict) -> None:
    print("\n| routing (held-out books) | locality | fan-out | ppl | ppl change |")
    print("|---|---|---|---|---|")
    for r in result["held_out_books"]["rows"]:
        print(f"| {r['label']} | {r['locality']:.3f} | {r['fan_out']:.2f} | {r['ppl']:.3f} "
              f"| {100 * r['ppl_change']:+.2f}% |")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.fill_between([0.85, 1.02], -1, 1, color="tab:green", alpha=0.08, lw=0)
    ax.axvline(0.85, color="0.6", ls=":", lw=1)
    ax.axhline(1.0, color="0.6", ls=":", lw=1)
    ax.text(0.855, 0.9, "target: locality >= 0.85,\nppl change <= +1%", fontsize=8, color="0.3", va="top")
    rows = result["rows"]

    def series(kind):
        pts = sorted((r["locality"], 100 * r["ppl_change"]) for r in rows if r["kind"] == kind)
        return [p[0] for p in pts], [p[1] for p in pts]

    ax.plot(*series("uniform"), "o-", color="tab:blue", label="hierarchical, one margin for all layers")
    ax.plot(*series("budget"), "s", color="tab:green", label="hierarchical, per-layer margins (calibration budgets)")
    d = next(r for r in rows if r["kind"] == "default")
    ax.plot(d["locality"], 100 * d["ppl_change"], "*", ms=16, color="tab:red", label="hierarchical default")
    ref = result["reference_points"]
    ax.plot(ref["flat_random_placement"]["locality"], 0, "kX", ms=9, label="flat, random placement")
    ax.plot(ref["flat_clustered_placement"]["locality"], 0, "kD", ms=7, label="flat, clustered placement")
    for r in rows:
        if r["kind"] in ("cluster_groups", "group_limited"):
            ax.plot(r["locality"], 100 * r["ppl_change"], "^", ms=8,
                    color="tab:purple" if r["kind"] == "cluster_groups" else "tab:orange", label=r["label"])
    ax.set_xlabel("locality (share of a token's experts on its top-1 expert's device)")
    ax.set_ylabel("perplexity change vs flat (%)")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(-1, 25)
    ax.set_xlim(0.58, 1.02)
    ax.set_title(f"tiny-moe, C = {result['clusters']} clusters, WikiText-2 ({result['tokens']} tokens)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
