#!/usr/bin/env python3
"""Perplexity of the tiny model with each KV format, on wikitext2_test and the held-out books.

Every format is run through `moekv.eval.perplexity` (decode mode: each scored token reads the
cache as generation would). Writes benchmarks/results/cpu/kv_quality_<model>.json, a markdown
table on stdout, and a plot of perplexity change against bits per element.

    python benchmarks/quality/kv_quality.py --max-tokens 30000
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from moekv import LLM  # noqa: E402
from moekv.config import default_model_path  # noqa: E402
from moekv.eval.perplexity import perplexity  # noqa: E402

TEXT_DIR = REPO.parent / "shared" / "data" / "text"

# (label, LLM keyword arguments); block_size 64 for every format so they share one page size.
FORMATS = [
    ("bf16", dict(kv_cache_dtype="bf16")),
    ("fp8_e4m3", dict(kv_cache_dtype="fp8_e4m3")),
    ("int4 g32", dict(kv_cache_dtype="int4", kv_group_size=32)),
    ("nuq2", dict(kv_cache_dtype="nuq2", kv_codebook="page")),
    ("nuq2 (calibrated)", dict(kv_cache_dtype="nuq2", kv_codebook="calibrated", needs_calibration=True)),
    ("vq", dict(kv_cache_dtype="vq", needs_calibration=True)),
    ("kivi2 (R=128)", dict(kv_cache_dtype="kivi2", kv_residual=128)),
    ("kivi2 (R=0)", dict(kv_cache_dtype="kivi2", kv_residual=0)),
    ("kivi2 G=64 (R=0)", dict(kv_cache_dtype="kivi2", kv_residual=0, kv_group_size=64)),
    ("tiered", dict(kv_cache_dtype="tiered", kv_codebook="page")),
    ("tiered (calibrated nuq2)", dict(kv_cache_dtype="tiered", kv_codebook="calibrated", needs_calibration=True)),
]


def held_out_books(out: Path) -> Path:
    subprocess.run([sys.executable, str(REPO / "scripts" / "export_heldout.py"), "--out", str(out)], check=True,
                   capture_output=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--max-tokens", type=int, default=30000, help="tokens of each text to score")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--calibration", default=None, help="folder from `moekv calibrate` (for vq)")
    p.add_argument("--texts", nargs="*", default=None, help="wikitext2_test and/or heldout_books (default: both)")
    p.add_argument("--formats", nargs="*", default=None, help="labels to run (default: all)")
    p.add_argument("--merge", nargs="*", default=[], help="earlier kv_quality JSON files whose rows join these")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp())
    texts = {"wikitext2_test": TEXT_DIR / "wikitext2_test.txt", "heldout_books": held_out_books(tmp / "heldout.txt")}
    rows = []
    for label, kwargs in FORMATS:
        if args.formats and label not in args.formats:
            continue
        kwargs = dict(kwargs)
        if kwargs.pop("needs_calibration", False):
            if not args.calibration:
                print(f"skipping {label}: needs --calibration", file=sys.stderr)
                continue
            kwargs["kv_calibration"] = args.calibration
        llm = LLM(args.model, dtype="float32", block_size=args.block_size, max_num_seqs=32, **kwargs)
        for text_name, path in texts.items():
            if args.texts and text_name not in args.texts:
                continue
            r = perplexity(llm, path, max_tokens=args.max_tokens, progress=True, mode="decode")
            rows.append({"format": label, **r.to_dict(), "text": text_name, "text_path": str(path)})
            print(f"{label:>16} {text_name:>15}: ppl {r.ppl:9.4f}  bits {r.bits_per_element:6.3f} "
                  f"(at window {r.bits_per_element_at_window:6.3f}, read {r.bits_per_element_read})  "
                  f"({r.seconds:.0f} s)",
                  flush=True)
    for earlier in args.merge:
        rows = json.loads(Path(earlier).read_text())["rows"] + rows
    base = {row["text"]: row["ppl"] for row in rows if row["format"] == "bf16"}
    for row in rows:
        row["ppl_change_vs_bf16"] = row["ppl"] / base[row["text"]] - 1 if row["text"] in base else None

    args.out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    record = {
        "model": name, "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "block_size": args.block_size, "max_tokens": args.max_tokens, "rows": rows,
    }
    (args.out / f"kv_quality_{name}.json").write_text(json.dumps(record, indent=2))
    print_table(rows)
    plot(rows, args.out / f"kv_quality_{name}.png")


def print_table(rows: list[dict]) -> None:
    texts = sorted({r["text"] for r in rows})
    print("\n| format | bits/elem (full pages) | bits/elem (one 512-token sequence, staging included) | "
          + " | ".join(f"ppl {t} (change)" for t in texts) + " |")
    print("|---|---|---|" + "---|" * len(texts))
    for label in dict.fromkeys(r["format"] for r in rows):
        cells = []
        bits = at_window = None
        for t in texts:
            r = next((r for r in rows if r["format"] == label and r["text"] == t), None)
            if r is None:
                cells.append("-")
                continue
            bits = r["bits_per_element_read"] or r["bits_per_element"]  # tiered: what attention read
            at_window = r["bits_per_element_at_window"]
            change = r["ppl_change_vs_bf16"]
            cells.append(f"{r['ppl']:.3f} ({100 * change:+.2f}%)" if change is not None else f"{r['ppl']:.3f}")
        print(f"| {label} | {bits:.2f} | {at_window:.2f} | " + " | ".join(cells) + " |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for text, marker in (("wikitext2_test", "o"), ("heldout_books", "s")):
        pts = [r for r in rows if r["text"] == text and r["ppl_change_vs_bf16"] is not None]
        xs = [r["bits_per_element_read"] or r["bits_per_element"] for r in pts]
        ax.scatter(xs, [100 * r["ppl_change_vs_bf16"] for r in pts], marker=marker, label=text)
        for x, r in zip(xs, pts):
            ax.annotate(r["format"], (x, 100 * r["ppl_change_vs_bf16"]), fontsize=8,
                        xytext=(4, 4), textcoords="offset points")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("bits per KV element (every byte of a full page)")
    ax.set_ylabel("perplexity change vs bf16 cache (%)")
    ax.set_title("tiny-moe: KV format quality (decode-mode perplexity)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
