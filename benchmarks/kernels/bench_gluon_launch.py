#!/usr/bin/env python3
"""The Gluon decode kernels' launch parameters against torch SDPA (bf16, flash) in one run: software
prefetch level (moekv/ops/gluon/prefetch.py: 0 none, 2 L2, 1 L1), ptxas register cap and split count.

int4, kivi2 and nuq2 on bench_decode_attention's pools (32 query / 8 KV heads, head_dim 128, pages of
64, the staged tail as the launch's extra split), the launchers of moekv/ops/gluon/<format>_decode.py
called directly. For each (format, shape): first every (prefetch, cap) at the default split count,
then the best of those at split counts around whole waves of the H200 (programs a wave = SMs x the
programs an SM holds at that cap: 65536 registers / (cap x 32), at most 32). Each time is the median
of CUDA-graph replays (triton.testing.do_bench_cudagraph); each launch's output on sequence 0 is
checked against the reference (a wrong one is kept with status "wrong" and does not compete).

    python benchmarks/kernels/bench_gluon_launch.py --out $OUT/gluon_launch.json
    python benchmarks/kernels/bench_gluon_launch.py --formats kivi2 --shapes 16x32768 --prefetch 0 2
    python benchmarks/kernels/bench_gluon_launch.py --formats int4 --prefetch 1 --caps none 168 --variants smem=1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode_attention as bda  # noqa: E402

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops.gluon.launch import MAX_SPLITS, default_num_splits, programs_per_sm  # noqa: E402

SHAPES = [(16, 32768), (64, 32768), (1, 131072), (1, 4096)]
# ptxas register caps per format (None: its own choice): the launcher's default first
CAPS = {"int4": [None, 168], "kivi2": [168, 184], "nuq2": [128, 160]}


def split_candidates(batch: int, pages: int, cap: int | None, sms: int, default: int) -> list[int]:
    """The default split count and those that fill 1..4 whole waves (the staged tail's programs beside
    them or not), within 1..min(pages / 2, MAX_SPLITS - 1)."""
    rows = batch * bda.NUM_KV_HEADS
    wave = sms * programs_per_sm(cap)
    top = max(1, min(-(-pages // 2), MAX_SPLITS - 1))
    out = {default}
    for w in (1, 2, 3, 4):
        for s in (w * wave // rows - 1, w * wave // rows):
            if 1 <= s <= top:
                out.add(s)
    return sorted(out)


def launcher(label, fmt, cache, ctx):
    """(the format's Gluon decode-attention launcher, its pool arguments: fragment view, staged tail and
    kivi2's residual ring)."""
    from moekv.ops.gluon import int4_decode, kivi2_decode, nuq2_decode

    kw = dict(frag=fmt.fragment_view(cache), staged=(cache["k_staging"], cache["v_staging"], ctx.seq_slots))
    if label == "kivi2":
        kw["residual"] = (cache["k_residual"], cache["v_residual"]) if fmt.residual else None
    attention = {"int4": int4_decode.int4_decode_attention, "kivi2": kivi2_decode.kivi2_decode_attention,
                 "nuq2": nuq2_decode.nuq2_decode_attention}[label]
    return attention, kw


def time_launch(fn, ref, tol) -> dict:
    out = fn()
    torch.cuda.synchronize()
    err = (out[:1].float() - ref).abs().max().item()
    return {"ms": bda.timer(fn, True), "max_abs_err": err, "status": "kernel" if err <= tol else "wrong"}


def run_shape(label, batch, context, args, device, gen, base, sms) -> dict:
    name, options = bda.FORMATS[label]
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="gluon", **options)  # pools in fragment order
    cache, ctx = bda.build_cache(fmt, batch, context, 64, device, gen)
    q = torch.randn(batch, bda.NUM_HEADS, bda.HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    scale = bda.HEAD_DIM ** -0.5
    ref = bda.reference_output(fmt, cache, ctx, q, context)
    tol = bda.tolerance(ref.abs().max().item())
    attention, kw = launcher(label, fmt, cache, ctx)
    pages = ctx.block_tables.shape[1]

    def default(cap):  # what the launcher picks with num_splits=None (launch.plan_launch)
        return default_num_splits(batch, bda.NUM_KV_HEADS, pages, 1, sms * programs_per_sm(cap))

    def launch(prefetch, cap, splits, **extra):
        return lambda: attention(q, block_tables=ctx.block_tables, context_lens=ctx.context_lens, scale=scale,
                                 num_splits=splits, max_registers=cap, prefetch=prefetch, **kw, **extra)

    row = {"format": f"{label}_gluon", "batch": batch, "context": context, "baseline_ms": base["ms"],
           "default_splits": default(CAPS[label][0]), "launches": []}
    caps = CAPS[label] if args.caps is None else args.caps
    for prefetch in args.prefetch:
        for cap in caps:
            r = {"prefetch": prefetch, "max_registers": cap, "num_splits": default(cap),
                 **time_launch(launch(prefetch, cap, None), ref, tol)}
            row["launches"].append(r)
            print(f"  {label} ({batch}, {context}) prefetch {prefetch} cap {cap} splits {r['num_splits']}: "
                  f"{r['ms'] * 1e3:.1f} us ({base['ms'] / r['ms']:.2f}x) {r['status']}", flush=True)
    for variant in args.variants:  # launcher options timed explicitly (e.g. smem=1), at each prefetch and cap
        for prefetch in args.prefetch:
            for cap in caps:
                r = {"prefetch": prefetch, "max_registers": cap, "num_splits": default(cap), "options": variant,
                     **time_launch(launch(prefetch, cap, None, **variant), ref, tol)}
                row["launches"].append(r)
                print(f"  {label} ({batch}, {context}) {variant} prefetch {prefetch} cap {cap}: "
                      f"{r['ms'] * 1e3:.1f} us ({base['ms'] / r['ms']:.2f}x) {r['status']}", flush=True)
    best = min((r for r in row["launches"] if r["status"] == "kernel"), key=lambda r: r["ms"], default=None)
    if best is not None and args.split_sweep:
        for splits in split_candidates(batch, pages, best["max_registers"], sms, best["num_splits"]):
            if splits == best["num_splits"]:
                continue
            extra = best.get("options", {})
            r = {"prefetch": best["prefetch"], "max_registers": best["max_registers"], "num_splits": splits,
                 "options": extra,
                 **time_launch(launch(best["prefetch"], best["max_registers"], splits, **extra), ref, tol)}
            row["launches"].append(r)
            print(f"  {label} ({batch}, {context}) {extra} prefetch {r['prefetch']} cap {r['max_registers']} splits "
                  f"{splits}: {r['ms'] * 1e3:.1f} us ({base['ms'] / r['ms']:.2f}x) {r['status']}", flush=True)
    good = [r for r in row["launches"] if r["status"] == "kernel"]
    dflt = row["launches"][0]
    row["default_ms"] = dflt["ms"]
    if good:
        best = min(good, key=lambda r: r["ms"])
        row.update(best=best, speedup_default=base["ms"] / dflt["ms"], speedup_best=base["ms"] / best["ms"])
    cache = ctx = q = None
    torch.cuda.empty_cache()
    return row


def options(text: str) -> dict:
    """KEY=INT[,KEY=INT] -> {KEY: INT}: one set of launcher options."""
    return {k: int(v) for k, v in (item.split("=") for item in text.split(","))}


def cap_arg(text: str) -> int | None:
    return None if text == "none" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="*", default=["kivi2", "int4", "nuq2"], choices=list(CAPS))
    ap.add_argument("--shapes", nargs="*", default=None, help="BATCHxCONTEXT, e.g. 16x32768")
    ap.add_argument("--prefetch", nargs="*", type=int, default=[0, 2, 1], help="PREFETCH levels (0 none, 2 L2, 1 L1)")
    ap.add_argument("--variants", nargs="*", type=options, default=[],
                    help="launcher options to time besides the defaults, one set each: KEY=INT[,KEY=INT] (e.g. "
                         "smem=1 for int4 and nuq2's codes and side tables through shared memory, "
                         "side_smem=1,codes_smem=1 for kivi2's)")
    ap.add_argument("--caps", nargs="*", type=cap_arg, default=None,
                    help="register caps to time (none: ptxas's choice); default: the format's CAPS")
    ap.add_argument("--no-split-sweep", dest="split_sweep", action="store_false", help="only the default split count")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "gluon_launch.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gluon_launch: needs a CUDA device")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    started = time.time()
    rows = []
    for batch, context in shapes:
        base = bda.sdpa_baseline(batch, context, device, gen, True)
        rows.append({"format": "sdpa_bf16", "batch": batch, "context": context, "ms": base["ms"]})
        print(f"({batch}, {context}) sdpa {base['ms'] * 1e3:.1f} us", flush=True)
        for label in args.formats:
            rows.append(run_shape(label, batch, context, args, device, gen, base, sms))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms,
                                            "command": " ".join(["python", *sys.argv]), "rows": rows}, indent=1))
    print(f"wrote {args.out} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
