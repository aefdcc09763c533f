"""`moekv calibrate-experts` (fit the expert predictor on calibration text) and `moekv eval experts`
(top-k recall of the predicted experts per layer); moekv/tools/experts.py does the work."""
from __future__ import annotations

import argparse
import json

from moekv.cli.engine_args import add_engine_args, llm_from
from moekv.config import default_model_path


def cmd_calibrate_experts(args: argparse.Namespace) -> int:
    from moekv.llm import LLM
    from moekv.tools.experts import calibrate_experts

    llm = LLM(model=args.model, dtype="float32" if args.device == "cpu" else "auto", device=args.device,
              max_model_len=args.window, max_num_batched_tokens=max(2048, 8 * (args.window or 512)))
    predictor, summary = calibrate_experts(llm, args.text, max_tokens=args.max_tokens, window=args.window,
                                           progress=not args.quiet, map=args.map, hidden=args.hidden,
                                           previous_token=args.previous_token, epochs=args.epochs)
    out = predictor.save(args.out)
    print(f"wrote {out} ({summary['tokens']} tokens); held-out top-{llm.engine.model_config.top_k} recall per layer:")
    print(f"{'layer':>5} {'pre-gating':>10} {'fitted':>8} {'alpha':>8}")
    for i, s in summary["layers"].items():
        print(f"{i:>5} {s['holdout_recall_pregate']:>10.3f} {s['holdout_recall_fitted']:>8.3f} {s['alpha']:>8g}")
    print(f"use it with --expert-predictor {out}")
    return 0


def add_calibrate_experts_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate-experts",
                              help="fit the expert predictor (per-layer linear maps, routing frequencies) on text")
    p.add_argument("--model", default=str(default_model_path()),
                   help="Hugging Face checkpoint folder (default: the bundled models/domain-moe)")
    p.add_argument("--text", nargs="+", required=True,
                   help="UTF-8 calibration text(s) (never the text you evaluate on)")
    p.add_argument("--out", required=True, help="file to write (safetensors)")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens in all (split evenly over the files)")
    p.add_argument("--window", type=int, default=None, help="tokens per prefill window (default: the model's context)")
    p.add_argument("--map", default="linear", choices=["linear", "mlp"],
                   help="per-layer map: linear (ridge least squares) or mlp (linear + one GELU layer, "
                        "trained to the router's softmax)")
    p.add_argument("--hidden", type=int, default=64, help="--map mlp: width of the hidden layer")
    p.add_argument("--epochs", type=int, default=12, help="--map mlp: training epochs (best held-out one kept)")
    p.add_argument("--previous-token", action="store_true",
                   help="the map also reads the previous token's residual entering the layer "
                        "(`eval experts` only: the engine's prefetch refuses such a file)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the text is scored")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_calibrate_experts)
    return p


def cmd_eval_experts(args: argparse.Namespace) -> int:
    from moekv.tools.experts import evaluate_expert_prediction

    llm = llm_from(args)
    record = evaluate_expert_prediction(llm, args.text, args.expert_predictor, max_tokens=args.max_tokens,
                                        window=args.window, progress=not args.json)
    if not args.json:
        k = record["top_k"]
        print(f"expert prediction over {record['tokens']} tokens of {args.text} (top-{k} of {record['num_experts']}; "
              f"a miss copies {record['expert_bytes']:,} bytes)")
        keys = [key for key in record["mean"]]
        print(f"{'layer':>5} " + " ".join(f"{key.removeprefix('recall_'):>16}" for key in keys))
        for i, s in record["per_layer"].items():
            print(f"{i:>5} " + " ".join(f"{s[key]:>16.3f}" for key in keys))
        print(f"{'mean':>5} " + " ".join(f"{record['mean'][key]:>16.3f}" for key in keys))
    print(json.dumps(record) if args.json else "")
    return 0


def add_eval_experts_parser(eval_subparsers) -> argparse.ArgumentParser:
    """Register `eval experts` on the `moekv eval` sub-command parsers."""
    p = eval_subparsers.add_parser("experts", help="recall of the predicted next experts per MoE layer")
    add_engine_args(p)
    p.add_argument("--text", required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--max-tokens", type=int, default=16384, help="use at most this many tokens of the text")
    p.add_argument("--window", type=int, default=None, help="tokens per prefill window (default: max_model_len)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.set_defaults(func=cmd_eval_experts)
    return p
