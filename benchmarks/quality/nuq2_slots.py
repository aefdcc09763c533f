#!/usr/bin/env python3
"""How many outlier slots nuq2 uses a page-head on a checkpoint's real keys and values, per outlier
threshold (and per slot cap), with what the Gluon decode kernel does with them: it adds the slots in
chunks of 16 a kind (keys, values), the first chunk of each kind always, a further chunk only on a
page-head that uses more than 16 (nuq2_kernel.py). So beside the mean count (what
bench_decode_attention.py's `used_slots_per_page_head` reports on random pages: keys' and values'
together) this reports the share of page-heads past 16 of each kind and the further chunks a
page-head runs on average, the kernel's work beyond the first chunks.

The model runs in `transformers` (float32) on the first --window tokens of each held-out domain (as
kv_statistics.py); keys are taken after RoPE (what nuq2's pages hold by default), values as v_proj
writes them. Every full page of 64 tokens of every layer and KV head goes through the engine's nuq2
quantizer (`NUQ2Format.quantize`, per-page codebooks) and its slots are counted. `--random` adds the
same counts on bench_decode_attention.py's random pages (its `random_kv`), which the kernel timings
are taken on. `--caps 3.0:16` adds a threshold with nuq2's `outlier_cap` (the largest 16 a kind kept).

--times FILE (an H200 run of bench_decode_attention.py with rows nuq2_gluon at 3.0 and nuq2_sigma35_gluon,
on random pages) turns the counts into the kernel's time at each of its shapes by two models fitted on
those two rows: linear in the slots a page-head uses (the file's used_slots_per_page_head), and linear in
the further chunks a page-head runs (this run's counts on random pages at 3.0 and 3.5: needs --random and
both thresholds); and the budget each model gives for --target-times (the issue's 3.5-sigma times) plus
--margin (10%).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quality/nuq2_slots.py --sigmas 3.0 3.25 3.5 \\
        --caps 3.0:16 --random --times benchmarks/results/h200/decode_attention_nuq2_fp16_slot_deltas.json \\
        --out benchmarks/results/cpu/nuq2_slots_domain-moe.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from result_paths import repo_path, repo_relative  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "domain-moe"
CHUNK = 16  # slots the Gluon kernel adds at a time, per kind (nuq2_kernel.py)
PAGE = 64  # the Gluon kernel's page (block_size)


def used_slots(fmt, pages: torch.Tensor, kind: str) -> torch.Tensor:
    """pages [n, H, P, D] -> the slots nuq2's quantizer fills on each page-head, [n * H] int64."""
    from moekv.kvcache.formats.nuq2 import NO_OUTLIER

    idx = fmt.quantize(pages, kind)["out_idx"]  # uint16 [n, H, S], NO_OUTLIER unused
    return (idx.to(torch.int32) != NO_OUTLIER).sum(-1).reshape(-1)


def further_chunks(used: torch.Tensor) -> torch.Tensor:
    """The chunks of 16 the kernel runs past its first, unconditional one, per page-head."""
    return ((used + CHUNK - 1) // CHUNK - 1).clamp(min=0)


def summary(key: torch.Tensor, value: torch.Tensor) -> dict[str, float]:
    """Counts per page-head of both kinds -> the figures the report prints."""
    k, v = key.double(), value.double()
    return {"key_mean": float(k.mean()), "value_mean": float(v.mean()), "total_mean": float((k + v).mean()),
            "key_max": int(key.max()), "value_max": int(value.max()),
            "key_over_16": float((key > CHUNK).double().mean()),
            "value_over_16": float((value > CHUNK).double().mean()),
            "key_over_32": float((key > 2 * CHUNK).double().mean()),
            "further_chunks": float((further_chunks(key) + further_chunks(value)).double().mean()),
            "page_heads": int(key.numel())}


def count(pages: dict[str, torch.Tensor], sigma: float, cap: int | None) -> dict:
    """pages {'key': [n, H, P, D], 'value': ...} -> summary at this threshold and cap."""
    from moekv.kvcache.formats.nuq2 import NUQ2Format

    fmt = NUQ2Format(outlier_sigma=sigma, codebook="page", residual=0, quantize_kernel=False, outlier_cap=cap)
    return summary(used_slots(fmt, pages["key"], "key"), used_slots(fmt, pages["value"], "value"))


def model_pages(model_dir: Path, window: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Path]]:
    """{domain: {'key': pages, 'value': pages}}, every layer's full pages stacked, [n, Hkv, 64, D]."""
    from kv_statistics import Capture, load
    from tokenizers import Tokenizer

    from moekv.eval.perplexity import text_files

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    domains = text_files(model_dir / "heldout")
    out = {}
    for name, path in domains.items():
        capture = Capture()
        model = load(model_dir, capture)
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False).ids[:window]
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
        pages = {}
        for kind, chunks in (("key", capture.keys_post), ("value", capture.values)):
            x = torch.cat(chunks, dim=0)  # [layers, Hkv, T, D] (batch 1 each)
            full = x.shape[2] // PAGE * PAGE
            layers, heads, _, dim = x.shape
            pages[kind] = x[:, :, :full].reshape(layers, heads, full // PAGE, PAGE, dim).transpose(1, 2) \
                .reshape(-1, heads, PAGE, dim).contiguous()
        out[name] = pages
    return out, domains


def random_pages(n: int) -> dict[str, torch.Tensor]:
    """bench_decode_attention.py's random pages (two outlier key channels a head), n of them."""
    sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))
    from bench_decode_attention import random_kv

    k, v = random_kv(n, PAGE, "cpu", torch.Generator().manual_seed(0))
    return {"key": k, "value": v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--window", type=int, default=4096, help="tokens read from each held-out domain")
    p.add_argument("--sigmas", type=float, nargs="+", default=[3.0, 3.25, 3.5])
    p.add_argument("--caps", nargs="*", default=[], metavar="SIGMA:CAP",
                   help="thresholds with nuq2's outlier_cap, e.g. 3.0:16 (the largest 16 a kind kept)")
    p.add_argument("--random", action="store_true", help="also bench_decode_attention.py's random pages")
    p.add_argument("--random-pages", type=int, default=512, help="how many (its UNIQUE_PAGES)")
    p.add_argument("--times", type=Path, default=None, help="an H200 bench_decode_attention.py result (see above)")
    p.add_argument("--target-times", type=Path, default=REPO / "benchmarks/results/h200/decode_attention_gluon.json",
                   help="the times to stay near: this file's nuq2_gluon rows (taken at 3.5)")
    p.add_argument("--margin", type=float, default=0.10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    settings = [(s, None) for s in args.sigmas] + [(float(t.split(":")[0]), int(t.split(":")[1])) for t in args.caps]
    if args.times and not (args.random and {3.0, 3.5} <= set(args.sigmas)):
        p.error("--times needs --random and --sigmas 3.0 and 3.5 (the chunk model's two points)")

    sets, domains = model_pages(args.model, args.window)
    sets = {"all": {kind: torch.cat([d[kind] for d in sets.values()]) for kind in ("key", "value")}, **sets}
    if args.random:
        sets["random"] = random_pages(args.random_pages)
    rows = []
    for sigma, cap in settings:
        label = f"{sigma:g}" + (f" cap {cap}" if cap is not None else "")
        for name, pages in sets.items():
            row = {"sigma": sigma, "outlier_cap": cap, "pages": name, **count(pages, sigma, cap)}
            rows.append(row)
            print(f"{label:>16} {name:>7}: slots a page-head {row['total_mean']:5.1f} (keys {row['key_mean']:5.1f},"
                  f" max {row['key_max']:2d}; values {row['value_mean']:5.1f}, max {row['value_max']:2d}); past 16:"
                  f" keys {100 * row['key_over_16']:5.1f}%, values {100 * row['value_over_16']:5.1f}%;"
                  f" further chunks {row['further_chunks']:.2f}", flush=True)
    models = time_models(rows, args) if args.times else None
    if args.out:
        record = {"model": args.model.name, "dtype": "float32", "window": args.window, "page": PAGE,
                  "domains": {name: repo_path(path) for name, path in domains.items()},
                  "command": "python benchmarks/quality/nuq2_slots.py " + " ".join(sys.argv[1:]),
                  "rows": rows, "time_models": models}
        args.out.write_text(json.dumps(repo_relative(record), indent=1))


def gluon_times(path: Path, label: str) -> dict[tuple[int, int], dict]:
    """(batch, context) -> the row of `label` in a bench_decode_attention.py result."""
    return {(r["batch"], r["context"]): r for r in json.loads(path.read_text())["rows"] if r["format"] == label}


def time_models(rows: list[dict], args) -> dict:
    """The kernel's time (us) a shape by the two models (module docstring), their budgets, and each
    setting's predicted time and change against the target on each set of pages."""
    slow, fast = gluon_times(args.times, "nuq2_gluon"), gluon_times(args.times, "nuq2_sigma35_gluon")
    target = gluon_times(args.target_times, "nuq2_gluon")
    chunks = {r["sigma"]: r["further_chunks"] for r in rows if r["pages"] == "random" and r["outlier_cap"] is None}
    shapes = {}
    for shape in sorted(set(slow) & set(fast) & set(target)):
        t30, t35 = slow[shape]["ms"] * 1e3, fast[shape]["ms"] * 1e3
        s30, s35 = slow[shape]["used_slots_per_page_head"], fast[shape]["used_slots_per_page_head"]
        per_slot = (t30 - t35) / (s30 - s35)
        per_chunk = (t30 - t35) / (chunks[3.0] - chunks[3.5])
        budget = (1 + args.margin) * target[shape]["ms"] * 1e3
        shapes[f"{shape[0]}x{shape[1]}"] = {
            "t30_us": t30, "t35_us": t35, "slots_30": s30, "slots_35": s35,
            "target_us": target[shape]["ms"] * 1e3, "budget_us": budget,
            "us_per_slot": per_slot, "slots_at_zero_us": t35 - per_slot * s35,
            "slot_budget": s35 + (budget - t35) / per_slot,
            "us_per_chunk": per_chunk, "chunk_budget": chunks[3.5] + (budget - t35) / per_chunk}
    print(f"\nkernel time models (us) from {repo_path(args.times)}; budget {1 + args.margin:.2f} x "
          f"{repo_path(args.target_times)}'s nuq2_gluon")
    for name, m in shapes.items():
        print(f"  {name:>9}: 3.5 {m['t35_us']:7.1f}, 3.0 {m['t30_us']:7.1f}, target {m['target_us']:7.1f}: "
              f"{m['us_per_slot']:.4f} us a slot a page-head (budget {m['slot_budget']:.1f} slots), "
              f"{m['us_per_chunk']:.3f} us a further chunk (budget {m['chunk_budget']:.2f} chunks)")
    predictions = []
    for row in rows:
        entry = {"sigma": row["sigma"], "outlier_cap": row["outlier_cap"], "pages": row["pages"]}
        for name, m in shapes.items():
            by_slots = m["t35_us"] + m["us_per_slot"] * (row["total_mean"] - m["slots_35"])
            by_chunks = m["t35_us"] + m["us_per_chunk"] * (row["further_chunks"] - chunks[3.5])
            entry[name] = {"by_slots_us": by_slots, "by_chunks_us": by_chunks,
                           "by_slots_change": by_slots / m["target_us"] - 1,
                           "by_chunks_change": by_chunks / m["target_us"] - 1}
        predictions.append(entry)
        if row["pages"] in ("all", "random"):
            label = f"{row['sigma']:g}" + (f" cap {row['outlier_cap']}" if row["outlier_cap"] else "")
            print(f"  {label:>10} {row['pages']:>6}: against the target, by slots " + " / ".join(
                f"{100 * entry[n]['by_slots_change']:+.0f}%" for n in shapes) + "; by chunks " + " / ".join(
                f"{100 * entry[n]['by_chunks_change']:+.0f}%" for n in shapes))
    return {"times": repo_path(args.times), "target_times": repo_path(args.target_times), "margin": args.margin,
            "further_chunks_random": chunks, "shapes": shapes, "predictions": predictions}


if __name__ == "__main__":
    main()
