#!/usr/bin/env python3
"""How domain-moe's experts specialise by domain (CPU).

Runs each held-out domain text (models/domain-moe/heldout/{prose,drama,code,math}.txt) through the
engine with flat routing (the model's own top-k) in non-overlapping windows, observes every MoE
layer's routing decisions (a router tap, as `moekv eval routing` / `moekv cluster` do), and writes
  share[layer][domain][expert] = that domain's routed assignments (top-k slots) going to that expert
(each row sums to 1; uniform would be 1/E), the same for routing weight, and per layer the mutual
information between domain and expert (bits; 0 = no specialisation, at most log2(4) = 2 bits) and each
domain's share in its own 4 most-used experts (uniform: 4/E). JSON and a heat-map PNG (one panel per
layer, domains as rows, experts as columns).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/expert_specialisation.py   # ~1 min
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))

from result_paths import repo_path  # noqa: E402

from moekv import LLM  # noqa: E402
from moekv.eval.perplexity import read_text_tokens  # noqa: E402
from moekv.models.loader import moe_layers  # noqa: E402
from moekv.routing.tap import tapped  # noqa: E402

MODEL = REPO / "models" / "domain-moe"
OUT_DIR = REPO / "benchmarks" / "results" / "cpu"
DOMAINS = ("prose", "drama", "code", "math")


def mutual_information(counts: torch.Tensor) -> float:
    """I(domain; expert) in bits from a [D, E] count table, domains weighted equally."""
    p_e_given_d = counts / counts.sum(1, keepdim=True)
    p_d = torch.full((counts.shape[0], 1), 1.0 / counts.shape[0], dtype=torch.float64)
    joint = p_d * p_e_given_d
    p_e = joint.sum(0, keepdim=True)
    nz = joint > 0
    return float((joint[nz] * torch.log2(joint[nz] / (p_d.expand_as(joint)[nz] * p_e.expand_as(joint)[nz]))).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--max-tokens", type=int, default=16384, help="held-out tokens per domain")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--out", type=Path, default=OUT_DIR / "expert_specialisation_domain-moe.json")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG (and --cluster-map's shares) from --out")
    p.add_argument("--cluster-map", type=Path, default=OUT_DIR / "domain-moe.clusters4.safetensors",
                   help="also record each domain's share in each cluster of this map ('' for none)")
    args = p.parse_args()
    if args.replot:
        result = json.loads(args.out.read_text())
        add_cluster_shares(result, args.cluster_map)
        args.out.write_text(json.dumps(result, indent=1))
        plot(result, args.out.with_suffix(".png"))
        return
    llm = LLM(model=str(args.model), dtype="float32", routing="flat", max_model_len=args.window,
              max_num_batched_tokens=max(4096, 2 * args.window))
    cfg = llm.engine.model_config
    layers = moe_layers(llm.engine.runner.model)
    E = cfg.num_experts
    counts = {i: torch.zeros(len(DOMAINS), E, dtype=torch.float64) for i in layers}
    weights = {i: torch.zeros(len(DOMAINS), E, dtype=torch.float64) for i in layers}
    current = [0]

    def observe(layer_idx, hidden, router_logits, w, ids):
        d = current[0]
        counts[layer_idx][d].index_add_(0, ids.flatten().cpu(), torch.ones(ids.numel(), dtype=torch.float64))
        weights[layer_idx][d].index_add_(0, ids.flatten().cpu(), w.flatten().double().cpu())

    t0 = time.perf_counter()
    tokens = {}
    with tapped(layers, observe):
        for d, domain in enumerate(DOMAINS):
            current[0] = d
            ids = read_text_tokens(llm.tokenizer, args.model / "heldout" / f"{domain}.txt", args.max_tokens)
            tokens[domain] = len(ids)
            chunks = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
            for n, chunk in enumerate(chunks):
                llm.score([{"prompt_token_ids": chunk}])
                print(f"[{time.perf_counter() - t0:6.0f} s] {domain}: window {n + 1}/{len(chunks)}", flush=True)
    result = {"model": repo_path(args.model),
              "routing": "flat", "num_experts": E, "top_k": cfg.top_k, "domains": list(DOMAINS),
              "tokens": tokens, "window": args.window, "seconds": time.perf_counter() - t0,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} python "
                         f"benchmarks/quality/expert_specialisation.py {' '.join(sys.argv[1:])}".strip(),
              "layers": {}}
    for i in layers:
        c = counts[i]
        share = c / c.sum(1, keepdim=True)
        wshare = weights[i] / weights[i].sum(1, keepdim=True)
        top4 = share.sort(1, descending=True).values[:, :4].sum(1)
        result["layers"][str(i)] = {
            "assignment_share": {dom: [round(float(x), 5) for x in share[d]] for d, dom in enumerate(DOMAINS)},
            "weight_share": {dom: [round(float(x), 5) for x in wshare[d]] for d, dom in enumerate(DOMAINS)},
            "mutual_information_bits": mutual_information(c),
            "top4_share": {dom: float(top4[d]) for d, dom in enumerate(DOMAINS)},
            "dominant_domain_per_expert": [DOMAINS[int(share[:, e].argmax())] for e in range(E)],
        }
        print(f"layer {i}: I(domain; expert) {result['layers'][str(i)]['mutual_information_bits']:.3f} bits "
              f"(max {math.log2(len(DOMAINS)):.0f}); share in own top-4 experts "
              + ", ".join(f"{dom} {float(top4[d]):.2f}" for d, dom in enumerate(DOMAINS)) + f" (uniform {4 / E:.2f})")
    add_cluster_shares(result, args.cluster_map)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def add_cluster_shares(result: dict, map_path: Path | None) -> None:
    """result["clusters"]: the map's experts per cluster and, per layer and domain, the share of the
    domain's assignments that land in each cluster (how well the clustering separates the domains)."""
    if not map_path or not Path(map_path).is_file():
        return
    from moekv.routing.cluster_map import ClusterMap

    cmap = ClusterMap.load(map_path)
    out = {"map": repo_path(map_path), "layers": {}}
    for i in sorted(cmap.layers):
        experts = cmap.layers[i].experts.tolist()
        share = result["layers"][str(i)]["assignment_share"]
        out["layers"][str(i)] = {"experts": experts,
                                 "domain_share": {d: [round(sum(share[d][e] for e in c), 4) for c in experts]
                                                  for d in result["domains"]}}
        print(f"layer {i}: share in each cluster " + "; ".join(
            f"{d} {out['layers'][str(i)]['domain_share'][d]}" for d in result["domains"]))
    result["clusters"] = out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(result["layers"])
    domains = result["domains"]
    E = result["num_experts"]
    fig, axes = plt.subplots(len(layers), 1, figsize=(9, 1.5 + 1.5 * len(layers)), squeeze=False,
                             gridspec_kw={"hspace": 0.6})
    lo, hi = min(result["tokens"].values()), max(result["tokens"].values())
    n_tokens = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
    vmax = max(max(max(r) for r in result["layers"][i]["assignment_share"].values()) for i in layers)
    for ax, i in zip(axes[:, 0], layers):
        m = [result["layers"][i]["assignment_share"][d] for d in domains]
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set_yticks(range(len(domains)), domains)
        ax.set_xticks(range(E))
        ax.set_title(f"layer {i}: share of the domain's routed assignments per expert "
                     f"(I = {result['layers'][i]['mutual_information_bits']:.2f} bits; uniform {1 / E:.3f})",
                     fontsize=9)
        for d in range(len(domains)):
            for e in range(E):
                ax.text(e, d, f"{100 * m[d][e]:.0f}", ha="center", va="center", fontsize=6,
                        color="white" if m[d][e] < vmax / 2 else "black")
    axes[-1, 0].set_xlabel("expert")
    fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.6, label="share")
    fig.suptitle(f"{result['model']}: expert use by held-out domain (flat top-{result['top_k']}, "
                 f"{n_tokens} tokens per domain)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
