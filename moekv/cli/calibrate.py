"""`moekv calibrate`: fit the KV formats' learned tables (codebooks, key channel scales) on a text file,
for every format that declares a calibration fitter, read back with `--kv-calibration DIR`."""
from __future__ import annotations

import argparse

from moekv.config import default_model_path


def cmd_calibrate(args: argparse.Namespace) -> int:
    import json

    from moekv.tools.calibrate import RECORD_FILE, calibrate

    out = calibrate(args.model, args.text, args.out, max_tokens=args.max_tokens, window=args.window,
                    block_size=args.block_size, seed=args.seed, progress=not args.quiet, device=args.device,
                    keys_before_rope=args.keys_before_rope)
    record = json.loads((out / RECORD_FILE).read_text())
    print(f"wrote {out} ({record['tokens_used']} tokens of {args.text}; tables of {', '.join(record['formats'])}: "
          f"{record['total_bytes']:,} bytes); use it with --kv-calibration {out}")
    return 0


def add_calibrate_parser(subparsers) -> argparse.ArgumentParser:
    """Register `calibrate` on the `moekv` sub-command parsers."""
    p = subparsers.add_parser("calibrate", help="fit KV-cache codebooks and scales on calibration text "
                                                "(for the formats that take --kv-calibration)")
    p.add_argument("--model", default=str(default_model_path()),
                   help="Hugging Face checkpoint folder (default: the bundled models/domain-moe)")
    p.add_argument("--text", required=True, help="UTF-8 calibration text (never the text you evaluate on)")
    p.add_argument("--out", required=True, help="folder to write kv_calibration.safetensors and .json into")
    p.add_argument("--max-tokens", type=int, default=65536, help="use at most this many tokens of the text")
    p.add_argument("--window", type=int, default=512, help="tokens scored at once (capped by the model's context)")
    p.add_argument("--block-size", type=int, default=64, help="page size the per-page statistics are taken over")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling of pages and the fits")
    p.add_argument("--device", default="cpu", help="cpu | cuda: where the text is scored (fp32 on either)")
    p.add_argument("--keys-before-rope", action="store_true",
                   help="fit the key tables on keys before RoPE, for --kv-keys-before-rope (recorded in the .json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_calibrate)
    return p
