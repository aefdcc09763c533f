#!/usr/bin/env python3
"""Hierarchical routing on domain-moe: `moekv cluster` on TRAINING text of the four domains, then
`moekv eval routing` (flat and hierarchical) on each domain's held-out text (CPU).

1. Calibration files from the training parts only (the held-out parts are the tails of the novels and
   of Tiny Shakespeare, every 20th stdlib module from the 11th, and math from seed 1235): the start of
   War and Peace (Gutenberg boilerplate stripped, cp1252 punctuation fixed), the start of Tiny
   Shakespeare, the first stdlib modules (skipping held-out ones), math from the training seed 1234.
2. `moekv cluster --clusters 4` on them -> benchmarks/results/cpu/domain-moe.clusters4.safetensors.
3. `moekv eval routing --json` per held-out domain: flat, hierarchical (map's margins), and
   hierarchical with one uniform margin per run (--margins).
4. JSON and a markdown table.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/domain_routing.py   # ~7 min on a shared 2-core machine
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from prepare_domain_data import fix_cp1252, math_corpus, split_modules, strip_gutenberg  # noqa: E402
from result_paths import repo_path, repo_relative  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
MODEL = REPO / "models" / "domain-moe"
OUT_DIR = REPO / "benchmarks" / "results" / "cpu"
DOMAINS = ("prose", "drama", "code", "math")


def calibration_files(out: Path, chars: int) -> list[Path]:
    """One training-part file per domain, `chars` characters each."""
    out.mkdir(parents=True, exist_ok=True)
    prose = fix_cp1252(strip_gutenberg((SHARED / "text" / "pg2600.txt").read_text(encoding="utf-8")))
    drama = (SHARED / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    modules = split_modules((SHARED / "code" / "cpython311_stdlib.txt").read_text(encoding="utf-8"))
    code = "".join(m for i, m in enumerate(modules[:200]) if i % 20 != 10)  # i % 20 == 10: held out
    maths = "".join(math_corpus(1234, chars))
    paths = []
    for name, text in (("prose", prose), ("drama", drama), ("code", code), ("math", maths)):
        path = out / f"calib_{name}.txt"
        path.write_text(text[:chars].replace("\r\n", "\n"), encoding="utf-8")
        paths.append(path)
    return paths


def run(cmd: list[str], label: str) -> str:
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {' '.join(cmd)}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=None, text=True, check=True)
    print(proc.stdout[-3000:], flush=True)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return proc.stdout


def eval_routing(text: Path, args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "moekv.cli", "eval", "routing", "--model", str(args.model), "--text", str(text),
           "--max-tokens", str(args.max_tokens), "--window", str(args.window), "--dtype", "float32", "--json", *extra]
    out = run(cmd, f"eval routing {text.stem} {' '.join(extra)}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--cluster-tokens", type=int, default=32768)
    p.add_argument("--quality-tokens", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens per domain")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--margins", type=lambda s: [float(x) for x in s.split(",") if x],
                   default=[4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -math.inf],
                   help="comma-separated uniform margins (one for every layer) to evaluate too, e.g. --margins=0,-inf "
                        "(-inf: one cluster per token)")
    p.add_argument("--calib-chars", type=int, default=60_000)
    p.add_argument("--work", type=Path, default=Path("/tmp/domain_routing"))
    p.add_argument("--map-out", type=Path, default=OUT_DIR / "domain-moe.clusters4.safetensors")
    p.add_argument("--out", type=Path, default=OUT_DIR / "routing_quality_domain-moe.json")
    p.add_argument("--skip-default", action="store_true",
                   help="no run with the map's own margins (when they keep every cluster it routes as flat does)")
    p.add_argument("--skip-flat", action="store_true", help="no flat run (when another --out has it)")
    p.add_argument("--skip-cluster", action="store_true", help="reuse --map-out")
    args = p.parse_args()
    random.seed(0)
    result = {"model": repo_path(args.model),
              "clusters": args.clusters, "max_tokens": args.max_tokens, "window": args.window,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "domains": {}}
    if args.skip_cluster and args.out.exists():  # keep the clustering run's report
        result["cluster_stdout"] = json.loads(args.out.read_text()).get("cluster_stdout")
    if not args.skip_cluster:
        calib = calibration_files(args.work, args.calib_chars)
        out = run([sys.executable, "-m", "moekv.cli", "cluster", "--model", str(args.model), "--text",
                   *map(str, calib), "--clusters", str(args.clusters), "--max-tokens", str(args.cluster_tokens),
                   "--quality-tokens", str(args.quality_tokens), "--window", str(args.window),
                   "--out", str(args.map_out)], "cluster")
        result["cluster_stdout"] = out
    hier = ["--routing", "hierarchical", "--cluster-map", str(args.map_out)]
    for domain in DOMAINS:
        text = args.model / "heldout" / f"{domain}.txt"
        rows = {} if args.skip_flat else {
            "flat": eval_routing(text, args, ["--routing", "flat", "--cluster-map", str(args.map_out)])}
        if not args.skip_default:
            rows["hierarchical"] = eval_routing(text, args, hier)
        for m in args.margins:
            rows[f"margin {m:g}"] = eval_routing(text, args, hier + [f"--cluster-admit-margin={m}"])
        result["domains"][domain] = rows
        args.out.write_text(json.dumps(repo_relative(result), indent=1, default=str))
    print_table(result)


def print_table(result: dict) -> None:
    print("| domain | routing | locality | fan-out | clusters/token | top-k sets = flat | ppl (change) |")
    print("|---|---|---|---|---|---|---|")
    for domain, rows in result["domains"].items():
        if "flat" not in rows:
            continue
        base = rows["flat"]["ppl"]
        for label, r in rows.items():
            pl = r["placements"]
            loc = pl.get("clustered", pl.get("random"))
            rnd = pl["random"]
            extra = f" (random placement {rnd['locality']:.3f})" if label == "flat" else ""
            print(f"| {domain} | {label} | {loc['locality']:.3f}{extra} | {loc['fan_out']:.2f} | "
                  f"{r.get('clusters_per_token', float('nan')):.2f} | {r['topk_agreement']['set']:.3f} | "
                  f"{r['ppl']:.3f} ({100 * (r['ppl'] / base - 1):+.2f}%) |")


if __name__ == "__main__":
    main()
