#!/usr/bin/env python3
"""Perplexity change and passkey retrieval against bits stored, for moekv's KV formats and
transformers' QuantizedCache peers, read from result JSONs (nothing is hard-coded).

--tables takes domain_model_tables.py results (one run, or several under `runs`); --peers takes
hf_quantized_cache_ppl.py results (perplexity and retrieval may come from separate files). Each
perplexity change is against the unquantized row of its own run (bf16 for moekv's runs, DynamicCache
for the peers), so runs on different devices and dtypes can share the axes. Decode-tail rows are
drawn filled; a format with no decode-tail row anywhere is drawn hollow from its prefill-window row
(which measures less of the format: docs/quality.md). Where several files give a format's row of a
kind, the last file given wins. Bits are per element at --context tokens, staged page or residual
window included.

    python benchmarks/quality/plot_kv_tradeoff.py \\
        --tables benchmarks/results/h200/domain_moe_kv_tables.json \\
                 benchmarks/results/h100/domain_moe_kv_tables_exact_prefill.json \\
        --peers benchmarks/results/cpu/hf_quantized_cache_domain-moe.json \\
        --out benchmarks/results/cpu/kv_tradeoff_domain-moe.png
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Point:
    label: str
    bits: float  # per element at the context length, window or staged page included
    ppl_change: float | None  # percent against its run's unquantized row
    decode_tail: bool  # the perplexity was scored by decode steps (else prefill windows)
    retrieval: float | None  # percent right at the context length
    peer: bool  # a transformers QuantizedCache setting


def format_label(spec: str) -> str:
    """'nuq2:kv_codebook=page' -> 'nuq2 (page codebooks)', keys stored before RoPE and tiered's FP8 share
    named; the ranking's and other options are dropped (--skip the rows they would merge)."""
    name, *opts = spec.split(":")
    notes = []
    if "kv_codebook=page" in opts and name == "nuq2":
        notes.append("page codebooks")
    if "kv_keys_before_rope=True" in opts:
        notes.append("keys before RoPE")
    share = next((o.partition("=")[2] for o in opts if o.startswith("kv_tier1_fraction=")), None)
    if share is not None:
        notes.append(f"{100 * float(share):g}% FP8")
    return name + (f" ({', '.join(notes)})" if notes else "")


def table_points(record: dict, context: int, skip: frozenset[str] = frozenset()) -> list[Point]:
    """A domain_model_tables.py result (one run, or several under `runs`) -> one point per format row
    other than bf16 (the baseline of its run) and those named in `skip`."""
    points = []
    for run in record.get("runs", [record]):
        formats = run["formats"]
        base = formats.get("bf16")
        for spec, row in formats.items():
            if spec == "bf16" or spec in skip:
                continue
            total = row["ppl"]["total"]
            change = None
            if base is not None and base["ppl"]["total"]["mode"] == total["mode"]:
                change = 100 * (total["ppl"] / base["ppl"]["total"]["ppl"] - 1)
            ret = row.get("retrieval") or {}
            accuracy = ret.get("accuracy_by_length", {}).get(str(context))
            bits = ret.get("bits_per_element_at_length", {}).get(str(context))
            if bits is None:
                if total.get("window") != context:
                    raise ValueError(f"{spec}: no bits at {context} tokens in this result (window "
                                     f"{total.get('window')}); give --context {total.get('window')}")
                bits = total["bits_per_element_at_window"]
            points.append(Point(format_label(spec), bits, change, total["mode"] == "decode-tail",
                                None if accuracy is None else 100 * accuracy, peer=False))
    return points


def peer_points(record: dict, context: int) -> list[Point]:
    """An hf_quantized_cache_ppl.py result -> one point per quantized setting that ran (a run with
    --no-ppl gives retrieval only)."""
    settings = [s for s in record["settings"] if "error" not in s]
    measured = [s for s in settings if "ppl" in s]
    base = next((s for s in measured if s["backend"] is None), None)
    if measured and base is None:
        raise ValueError("the peer result holds no unquantized (DynamicCache) row to compare with")
    points = []
    for s in settings:
        if s["backend"] is None:
            continue
        change = 100 * (s["ppl"]["total"]["ppl"] / base["ppl"]["total"]["ppl"] - 1) if "ppl" in s else None
        accuracy = (s.get("retrieval") or {}).get("accuracy_by_length", {}).get(str(context))
        bits = s["bits_per_element_at"].get(str(context))
        if bits is None:
            raise ValueError(f"{s['label']}: no bits at {context} tokens (has {sorted(s['bits_per_element_at'])})")
        name = {"hqq": "HQQ"}.get(s["backend"], s["backend"])  # squares: the marker says transformers
        points.append(Point(f"{name} int{s['nbits']} g{s['q_group_size']}", bits, change,
                            record.get("protocol") == "decode-tail", None if accuracy is None else 100 * accuracy,
                            peer=True))
    return points


def merge(points: list[Point]) -> tuple[dict[str, Point], dict[str, Point]]:
    """(perplexity points, retrieval points) by label: decode-tail rows over prefill rows, later over
    earlier."""
    ppl: dict[str, Point] = {}
    ret: dict[str, Point] = {}
    for p in points:
        if p.ppl_change is not None and (p.label not in ppl or p.decode_tail or not ppl[p.label].decode_tail):
            ppl[p.label] = p
        if p.retrieval is not None:
            ret[p.label] = p
    return ppl, ret


def label_offsets(anchors: list[tuple[float, float]], widths: list[float], height: float) -> list[float]:
    """Vertical offsets (display units) for labels drawn right of their points at `anchors` (display
    coordinates), so that no two label boxes overlap: each label, left to right, takes the first of
    +0, -1, +1, -2, ... label heights that clears the boxes already placed."""
    placed: list[tuple[float, float, float, float]] = []
    offsets = [0.0] * len(anchors)
    for i in sorted(range(len(anchors)), key=lambda i: anchors[i]):
        x, y = anchors[i]
        for step in range(2 * len(anchors) + 1):
            dy = height * ((step + 1) // 2) * (1 if step % 2 == 0 else -1)
            box = (x, y + dy, x + widths[i], y + dy + height)
            if all(box[2] <= b[0] or b[2] <= box[0] or box[3] <= b[1] or b[3] <= box[1] for b in placed):
                break
        placed.append(box)
        offsets[i] = dy
    return offsets


def plot(ppl: dict[str, Point], ret: dict[str, Point], png: Path, context: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys([*ppl, *ret]))
    palette = plt.get_cmap("tab20")  # a colour a label in both panels, distinct up to 20 labels
    colors = {label: palette(i % 20) for i, label in enumerate(labels)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    left.set_yscale("symlog", linthresh=1.0)
    left.axhline(0.0, color="gray", linewidth=0.6)
    left.set_ylabel("perplexity change vs unquantized, all domains (%)")
    right.set_ylim(0, 118)  # room above 100% for the labels of the points there
    right.set_yticks(range(0, 101, 20))
    right.set_ylabel(f"passkeys right at {context} tokens (%)")
    panels = ((left, ppl, lambda p: p.ppl_change), (right, ret, lambda p: p.retrieval))
    notes = []
    for ax, points, value in panels:
        ax.set_xlabel(f"bits per element stored at {context} tokens")
        for label, p in points.items():
            filled = p.decode_tail or ax is right
            ax.scatter(p.bits, value(p), marker="s" if p.peer else "o", s=36, color=colors[label],
                       facecolors=colors[label] if filled else "none")
            notes.append((ax, ax.annotate(label + ("" if filled else " (prefill)"), (p.bits, value(p)),
                                          fontsize=7, xytext=(4, 0), textcoords="offset points")))
    fig.suptitle(title + "  (o moekv, s transformers QuantizedCache; hollow: prefill windows)", fontsize=9)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()  # the layout is fixed: labels can be placed in display units
    for ax in (left, right):
        mine = [n for a, n in notes if a is ax]
        boxes = [n.get_window_extent(renderer) for n in mine]
        offsets = label_offsets([(b.x0, b.y0) for b in boxes], [b.width for b in boxes],
                                max((b.height for b in boxes), default=0.0))
        for note, dy in zip(mine, offsets):
            note.xyann = (4, dy * 72 / fig.dpi)
    fig.savefig(png, dpi=fig.dpi)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=Path, nargs="*", default=[], help="domain_model_tables.py results")
    p.add_argument("--peers", type=Path, nargs="*", default=[], help="hf_quantized_cache_ppl.py results")
    p.add_argument("--skip", nargs="*", default=[], metavar="SPEC",
                   help="format rows of --tables left out (e.g. a sweep's variants)")
    p.add_argument("--context", type=int, default=4096, help="tokens at which bits and retrieval are read")
    p.add_argument("--title", default="KV formats on domain-moe")
    p.add_argument("--out", type=Path, required=True, metavar="PNG")
    args = p.parse_args()
    if not args.tables and not args.peers:
        p.error("give at least one result file (--tables and/or --peers)")
    points = []
    for path in args.tables:
        points += table_points(json.loads(path.read_text()), args.context, frozenset(args.skip))
    for path in args.peers:
        points += peer_points(json.loads(path.read_text()), args.context)
    ppl, ret = merge(points)
    plot(ppl, ret, args.out, args.context, args.title)
    for label in dict.fromkeys([*ppl, *ret]):
        a, b = ppl.get(label), ret.get(label)
        print(f"{label}: bits {(a or b).bits:.2f}, ppl "
              + (f"{a.ppl_change:+.2f}% ({'decode-tail' if a.decode_tail else 'prefill'})" if a else "-")
              + (f", retrieval {b.retrieval:.1f}%" if b else ""))


if __name__ == "__main__":
    main()
