#!/usr/bin/env python3
"""The routing experiment of domain-mla: locality by construction against the perplexity and retrieval it
costs, a group-trained DeepSeek-V3 model beside its flat-trained twin (scripts/train_domain_moe.py
--arch deepseek-v3, the same recipe with --n-group 1 --topk-group 1).

Every model is run with group-limited routing over G contiguous expert groups (G: the grouped model's
n_group; the flat twin gets the same groups imposed at inference) keeping k groups per token, for each
k of --topk-groups (k = G keeps every group: the flat twin's own routing; the grouped model's trained k
is its own). Each expert group lives on one of --num-devices devices (group g on device g mod D), and
per held-out domain `moekv eval routing` (moekv.eval.routing, prefill windows) gives
  perplexity, locality (the share of a token's experts on its top-1 expert's device), fan-out (devices
  per token, max_fan_out <= k by construction), cross-device bytes per token, and the same for random
  placements (the baseline);
then `moekv eval retrieval` (moekv.eval.retrieval) gives passkey accuracy with filler from each domain,
for the models' own routing (every k with --retrieval-all).
The perplexity change is against the flat twin's own routing on the same domain. domain-moe's post-hoc
clustering (benchmarks/quality/domain_routing.py, its committed JSON) is printed beside when present.

About 15 min on a shared 2-core CPU (each groups-kept count ~25 s over the four domains, each passkey
set of 120 prompts ~6 min; --retrieval-trials 1 halves that).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/group_routing.py \\
        --model grouped=models/domain-mla --model flat=/tmp/mla/flat \\
        --out benchmarks/results/cpu/group_routing_domain-mla.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_paths import repo_path, repo_relative  # noqa: E402

DOMAINS = ("prose", "drama", "code", "math")
HELDOUT = REPO / "models" / "domain-moe" / "heldout"
POSTHOC = REPO / "benchmarks" / "results" / "cpu" / "routing_quality_domain-moe.json"


def parse_model(spec: str) -> tuple[str, Path]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--model {spec!r}: use NAME=DIR")
    return name, Path(path)


def model_groups(path: Path) -> tuple[int, int]:
    """(n_group, topk_group) a checkpoint was trained with (1, 1: routed over every expert)."""
    cfg = json.loads((path / "config.json").read_text())
    return int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)


def fewest_groups(path: Path, n_group: int) -> int:
    """The fewest of n_group groups that hold the checkpoint's top-k experts."""
    cfg = json.loads((path / "config.json").read_text())
    per_group = int(cfg["n_routed_experts"]) // n_group
    return -(-int(cfg["num_experts_per_tok"]) // per_group)


def routing_rows(path: Path, n_group: int, topk_group: int, args) -> dict:
    """eval routing on every held-out domain with group-limited routing (n_group, topk_group)."""
    from moekv import LLM
    from moekv.eval.routing import evaluate_routing

    # eager: six short-lived engines, each decoding only a few tokens a prompt, gain nothing from graphs
    llm = LLM(str(path), dtype=args.dtype, device=args.device, routing="group_limited", n_group=n_group,
              topk_group=topk_group, max_model_len=args.max_model_len, enforce_eager=True)
    rows = {}
    for domain in DOMAINS:
        t0 = time.perf_counter()
        r = evaluate_routing(llm, args.heldout / f"{domain}.txt", max_tokens=args.max_tokens, window=args.window,
                             stride=args.stride, mode="prefill", num_devices=args.num_devices, progress=False)
        rnd = r["placements"]["random"]
        rows[domain] = {"ppl": r["ppl"], "tokens": r["tokens"], "locality": r["locality"], "fan_out": r["fan_out"],
                        "max_fan_out": r["max_fan_out"], "placement": r["placement"],
                        "cross_device_bytes_per_token": r["cross_device_bytes_per_token"],
                        "random_locality": rnd["locality"], "random_fan_out": rnd["fan_out"],
                        "topk_agreement_with_all_groups": r["topk_agreement"]["set"],
                        "per_layer_locality": {i: s.get("grouped_locality") for i, s in r["per_layer"].items()},
                        "seconds": round(time.perf_counter() - t0, 1)}
        print(f"  {domain}: ppl {r['ppl']:.3f}, locality {r['locality']:.3f}, fan-out {r['fan_out']:.2f} "
              f"(max {r['max_fan_out']}), random placement {rnd['locality']:.3f}", flush=True)
    return llm, rows


def retrieval_row(llm, args) -> dict:
    from moekv.eval.retrieval import evaluate_retrieval

    per_domain, correct, total = {}, 0, 0
    for domain in DOMAINS:
        res = evaluate_retrieval(llm, args.heldout / f"{domain}.txt", lengths=args.retrieval_lengths,
                                 depths=args.retrieval_depths, trials=args.retrieval_trials, seed=args.seed,
                                 progress=False)
        n = len(res.answers)
        per_domain[domain] = {"accuracy": res.accuracy, "by_length": res.accuracy_by_length, "prompts": n}
        correct += round(res.accuracy * n)
        total += n
    print(f"  passkeys {correct}/{total}", flush=True)
    return {"correct": correct, "total": total, "accuracy": correct / max(total, 1), "by_domain": per_domain}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=parse_model, action="append", required=True, metavar="NAME=DIR",
                   help="a model to measure (repeat it); the one trained with groups sets G")
    p.add_argument("--reference", default=None, help="NAME of the flat twin (default: the model trained with 1 group)")
    p.add_argument("--heldout", type=Path, default=HELDOUT, help="folder of <domain>.txt held-out texts")
    p.add_argument("--topk-groups", default="1,2,all", help="groups kept per token, comma-separated ('all': G)")
    p.add_argument("--num-devices", type=int, default=None, help="devices of the placement (default: G)")
    p.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens per domain")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=None, help="default: window / 2")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--retrieval-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--retrieval-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--retrieval-trials", type=int, default=2, help="keys per (length, depth) and filler domain")
    p.add_argument("--retrieval-all", action="store_true", help="passkeys at every k, not only each model's own")
    p.add_argument("--no-retrieval", action="store_true")
    p.add_argument("--seed", type=int, default=0, help="the passkeys' seed")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    models = dict(args.model)
    groups = {name: model_groups(path) for name, path in models.items()}
    trained_g = sorted({g for g, _ in groups.values() if g > 1})
    if len(trained_g) != 1:
        p.error(f"one n_group > 1 among the models is needed to place the experts; got {groups}")
    G = trained_g[0]
    reference = args.reference or next((n for n, (g, _) in groups.items() if g == 1), None)
    ks = sorted({G if k == "all" else int(k) for k in args.topk_groups.split(",")})
    args.num_devices = args.num_devices or G
    result = {"models": {n: repo_path(path) for n, path in models.items()}, "trained_groups": groups,
              "n_group": G, "num_devices": args.num_devices, "reference": reference,
              "max_tokens": args.max_tokens, "window": args.window, "stride": args.stride or args.window // 2,
              "device": args.device, "dtype": args.dtype, "heldout": repo_path(args.heldout),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": {}}
    for name, path in models.items():
        own_k = G if groups[name][0] == 1 else groups[name][1]
        for k in sorted(k for k in set(ks) | {own_k} if k >= fewest_groups(path, G)):
            label = f"{name} k={k}"
            print(f"[{time.strftime('%H:%M:%S')}] {label} ({path}, {G} groups, {k} kept)", flush=True)
            llm, rows = routing_rows(path, G, k, args)
            run = {"model": name, "topk_group": k, "own_routing": k == own_k, "domains": rows}
            if not args.no_retrieval and (k == own_k or args.retrieval_all):
                run["retrieval"] = retrieval_row(llm, args)
            del llm
            result["runs"][label] = run
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(repo_relative(result), indent=1))
    result["summary"] = summarise(result)
    args.out.write_text(json.dumps(repo_relative(result), indent=1))
    print_table(result)
    return result


def summarise(result: dict) -> dict:
    """Each run's perplexity change against the reference's own routing per domain, and whether the
    target holds: locality >= 0.85 at <= +1% perplexity on every domain."""
    ref = next((r for r in result["runs"].values() if r["model"] == result["reference"] and r["own_routing"]), None)
    out = {}
    for label, run in result["runs"].items():
        change = ({d: run["domains"][d]["ppl"] / ref["domains"][d]["ppl"] - 1 for d in DOMAINS}
                  if ref is not None else None)
        loc = {d: run["domains"][d]["locality"] for d in DOMAINS}
        out[label] = {"ppl_change": change, "locality": loc,
                      "target_met": None if change is None else
                      all(loc[d] >= 0.85 and change[d] <= 0.01 for d in DOMAINS)}
    return out


def print_table(result: dict) -> None:
    print(f"\n{result['n_group']} expert groups on {result['num_devices']} devices; perplexity change against "
          f"{result['reference']}'s own routing")
    print("| model | groups kept | domain | locality (random placement) | fan-out (max) | perplexity (change) |"
          " passkeys |")
    print("|---|---|---|---|---|---|---|")
    for label, run in result["runs"].items():
        s = result["summary"][label]
        pk = run.get("retrieval")
        for i, d in enumerate(DOMAINS):
            r = run["domains"][d]
            change = "" if s["ppl_change"] is None else f" ({100 * s['ppl_change'][d]:+.2f}%)"
            own = " (trained)" if run["own_routing"] else ""
            passkeys = f"{pk['correct']}/{pk['total']}" if pk and i == 0 else ""
            print(f"| {run['model']} | {run['topk_group']}{own} | {d} | {r['locality']:.3f} "
                  f"({r['random_locality']:.3f}) | {r['fan_out']:.2f} ({r['max_fan_out']}) | {r['ppl']:.3f}{change} "
                  f"| {passkeys} |")
    for label, s in result["summary"].items():
        if s["target_met"] is not None:
            print(f"{label}: locality >= 0.85 at <= +1% on every domain: {'met' if s['target_met'] else 'not met'}")
    if POSTHOC.is_file():  # domain-moe's post-hoc clustering, the comparison the experiment stands beside
        posthoc = json.loads(POSTHOC.read_text())["domains"]
        cells = [f"{d} {rows['hierarchical']['locality']:.3f} at "
                 f"{100 * (rows['hierarchical']['ppl'] / rows['flat']['ppl'] - 1):+.2f}%"
                 for d, rows in posthoc.items() if "hierarchical" in rows and "flat" in rows]
        print("domain-moe, post-hoc clustering (4 clusters on 4 devices, the map's margins): " + "; ".join(cells))


if __name__ == "__main__":
    main()
