#!/usr/bin/env python3
"""Expert prediction recall on models/domain-moe (CPU): pre-gating and a fitted predictor.

1. Calibration text from the four domains' TRAINING parts (domain_routing.calibration_files: the held-out
   parts are never read), `moekv calibrate-experts` on them -> benchmarks/results/cpu/domain-moe.experts.safetensors.
2. `moekv eval experts --json` on each domain's held-out text (models/domain-moe/heldout/), with and
   without the fitted file: top-k and top-2k recall per MoE layer.

    OMP_NUM_THREADS=1 python benchmarks/quality/expert_prediction_domain.py
    # the MLP map over 32,768 tokens a domain, with and without the previous token's residual (issue 28)
    OMP_NUM_THREADS=1 python benchmarks/quality/expert_prediction_domain.py --calib-tokens 131072 --map mlp \
        --predictor benchmarks/results/cpu/domain-moe.experts-mlp.safetensors \
        --out benchmarks/results/cpu/expert_prediction_domain-moe_mlp.json
    OMP_NUM_THREADS=1 python benchmarks/quality/expert_prediction_domain.py --calib-tokens 131072 --map mlp \
        --previous-token --predictor benchmarks/results/cpu/domain-moe.experts-mlp-prev.safetensors \
        --out benchmarks/results/cpu/expert_prediction_domain-moe_mlp-prev.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "quality"))

from domain_routing import DOMAINS, MODEL, OUT_DIR, calibration_files, run  # noqa: E402
from result_paths import repo_path, repo_relative  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calib-tokens", type=int, default=65536, help="calibration tokens over the four domains")
    p.add_argument("--calib-chars", type=int, default=200_000, help="characters of training text per domain")
    p.add_argument("--max-tokens", type=int, default=8192, help="held-out tokens per domain")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--map", default="linear", choices=["linear", "mlp"], help="calibrate-experts --map")
    p.add_argument("--hidden", type=int, default=64, help="calibrate-experts --hidden (--map mlp)")
    p.add_argument("--epochs", type=int, default=12, help="calibrate-experts --epochs (--map mlp)")
    p.add_argument("--previous-token", action="store_true", help="calibrate-experts --previous-token")
    p.add_argument("--predictor", type=Path, default=OUT_DIR / "domain-moe.experts.safetensors")
    p.add_argument("--out", type=Path, default=OUT_DIR / "expert_prediction_domain-moe.json")
    args = p.parse_args()
    args.predictor, args.out = args.predictor.resolve(), args.out.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        files = calibration_files(Path(tmp), args.calib_chars)
        run([sys.executable, "-m", "moekv.cli", "calibrate-experts", "--model", str(MODEL), "--text",
             *map(str, files), "--max-tokens", str(args.calib_tokens), "--window", str(args.window),
             "--out", str(args.predictor), "--map", args.map, "--hidden", str(args.hidden),
             "--epochs", str(args.epochs),
             *(["--previous-token"] if args.previous_token else []), "--quiet"], "calibrate-experts")
    record = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
              "model": "models/domain-moe", "calib_tokens": args.calib_tokens, "heldout_tokens": args.max_tokens,
              "window": args.window, "predictor": repo_path(args.predictor), "map": args.map,
              "hidden": args.hidden if args.map == "mlp" else None, "previous_token": args.previous_token,
              "domains": {}}
    for domain in DOMAINS:
        out = run([sys.executable, "-m", "moekv.cli", "eval", "experts", "--model", str(MODEL), "--dtype", "float32",
                   "--text", str(MODEL / "heldout" / f"{domain}.txt"), "--max-tokens", str(args.max_tokens),
                   "--window", str(args.window), "--expert-predictor", str(args.predictor), "--json"],
                  f"eval experts {domain}")
        record["domains"][domain] = json.loads(out.strip().splitlines()[-1])
    args.out.write_text(json.dumps(repo_relative(record), indent=2))
    print(f"{'domain':>6} {'layer':>5} {'pregate':>8} {'fitted':>8} {'fit@2k':>8}")
    for domain, r in record["domains"].items():
        for i, s in r["per_layer"].items():
            print(f"{domain:>6} {i:>5} {s['recall_pregate']:>8.3f} {s['recall_fitted']:>8.3f} "
                  f"{s['recall_fitted_at_2k']:>8.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
