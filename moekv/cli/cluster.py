"""`moekv cluster`: offline expert clustering -> a cluster map file (moekv/tools/cluster.py does the work)."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from moekv.config import default_model_path


def _fmt_margin(m: float) -> str:
    return "all" if m == math.inf else ("one" if m == -math.inf else f"{m:+.2f}")


def cmd_cluster(args: argparse.Namespace) -> int:
    from moekv.llm import LLM
    from moekv.routing.hierarchical import router_flops_per_token
    from moekv.tools.cluster import build_cluster_map, split_calibration

    llm = LLM(model=args.model, dtype="float32" if args.device == "cpu" else "auto", device=args.device,
              routing="flat", max_model_len=args.window, max_num_batched_tokens=max(2048, 8 * (args.window or 512)))
    cfg = llm.engine.model_config
    if cfg.num_experts % args.clusters:
        raise ValueError(f"--clusters {args.clusters} must divide num_experts={cfg.num_experts} (equal-size clusters)")
    cluster_ids, quality_ids = split_calibration(llm.tokenizer, args.text, args.max_tokens, args.quality_tokens)
    cmap, summary = build_cluster_map(llm, cluster_ids, args.clusters, quality_ids=quality_ids,
                                      ppl_budget=args.ppl_budget, clusters_per_token=args.clusters_per_token,
                                      restarts=args.restarts, seed=args.seed, progress=not args.quiet)
    out = Path(args.out or f"{Path(args.model).name}.clusters{args.clusters}.safetensors")
    cmap.save(out)
    print(f"\n{cfg.architecture}: {cfg.num_experts} experts x {sum(cfg.moe_layers)} MoE layers -> {args.clusters} "
          f"clusters of {cfg.num_experts // args.clusters}; {len(cluster_ids)} tokens for clustering, "
          f"{len(quality_ids)} for the margins (budget +{100 * args.ppl_budget:.1f}% ppl)")
    head = f"{'layer':>5} {'top-k in 1 cluster':>18} {'flat locality':>13} {'coarse acc':>10} {'margin':>7} " \
           f"{'locality':>8} {'clusters/tok':>12} {'ppl change':>10}"
    print(head)
    print("-" * len(head))
    for i, s in summary["layers"].items():
        print(f"{i:>5} {s['same_cluster_topk']:>18.3f} {s['flat_locality']:>13.3f} {s['coarse_top1_accuracy']:>10.3f} "
              f"{_fmt_margin(s['admit_margin']):>7} {s['hier_locality']:>8.3f} {s['hier_clusters_per_token']:>12.2f} "
              f"{100 * math.expm1(s['hier_delta_nll']):>+9.2f}%")
    mean_clusters = sum(s["hier_clusters_per_token"] for s in summary["layers"].values()) / len(summary["layers"])
    flops = router_flops_per_token(cfg.hidden_size, cfg.num_experts, args.clusters, mean_clusters)
    print(f"expected on calibration text: locality {summary['expected_locality']:.3f}, ppl change "
          f"{100 * summary['expected_ppl_change']:+.2f}% (layers measured one at a time); router "
          f"{flops['hierarchical']:,.0f} FLOPs/token vs flat {flops['flat']:,} ({100 * flops['saving']:+.1f}% saved)")
    print(f"wrote {out}; use it with --routing hierarchical --cluster-map {out}")
    return 0


def add_cluster_parser(subparsers) -> argparse.ArgumentParser:
    """Register `cluster` on the `moekv` sub-command parsers."""
    p = subparsers.add_parser("cluster", help="cluster each layer's experts offline and write a cluster map")
    p.add_argument("--model", default=str(default_model_path()),
                   help="Hugging Face checkpoint folder (default: the bundled models/domain-moe)")
    p.add_argument("--text", required=True, nargs="+", help="UTF-8 calibration text file(s) (not your evaluation text)")
    p.add_argument("--clusters", type=int, required=True, help="clusters per layer (must divide the expert count)")
    p.add_argument("--out", default=None, help="cluster map file (default: <model name>.clusters<C>.safetensors)")
    p.add_argument("--max-tokens", type=int, default=32768,
                   help="calibration tokens for co-activation and coarse gates")
    p.add_argument("--quality-tokens", type=int, default=8192,
                   help="further tokens on which each layer's margin is chosen (0: keep all clusters)")
    p.add_argument("--ppl-budget", type=float, default=0.01,
                   help="relative perplexity increase the margins may spend on the calibration text")
    p.add_argument("--clusters-per-token", type=int, default=0, help="most clusters per token (0: all)")
    p.add_argument("--window", type=int, default=None,
                   help="tokens per calibration window (default: the model's context)")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--restarts", type=int, default=16, help="random starts of the partition search")
    p.add_argument("--seed", type=int, default=0, help="seeds the partition search's random starts")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_cluster)
    return p
