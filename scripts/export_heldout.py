#!/usr/bin/env python3
"""Write the held-out validation split of the tiny model's training books (the last 5% of each
file, cut exactly as scripts/train_tiny_moe.py cuts it) to one text file, for `moekv eval ppl`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_moe import DEFAULT_DATA_DIR, DEFAULT_FILES, load_corpus  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--holdout-frac", type=float, default=0.05)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    docs = load_corpus(args.data_dir, DEFAULT_FILES, args.holdout_frac)
    args.out.write_text("\n".join(d["val"] for d in docs), encoding="utf-8")
    print(f"wrote {args.out} ({sum(len(d['val']) for d in docs):,} characters)")


if __name__ == "__main__":
    main()
