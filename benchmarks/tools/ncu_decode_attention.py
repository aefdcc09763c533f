#!/usr/bin/env python3
"""Launch one format's paged decode kernel a few times, for a profiler to attach to (Nsight Compute).

The cache is built as bench_decode_attention.py builds it (same random pages, same default launch
shape), then the kernel runs `--repeats` times with a sync after each, so that a profiler can skip
the first launches (compilation, warm caches) and record one:

    ncu --clock-control none --kernel-name regex:_paged_decode_kernel --launch-skip 2 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        python benchmarks/tools/ncu_decode_attention.py --format int4 --batch 16 --context 32768

`--kernel gluon` runs the engine's Gluon path instead (decode_kernel='gluon': a fragment-order pool and
KVFormat.attend, as bench_decode_attention's `<format>_gluon` rows; tiered on that bench's ~15% FP8 cache);
its kernels are named `<format>_decode_kernel` (`--kernel-name regex:decode_kernel`; vq's shared-codebook
kernel `vq_smem_decode_kernel`).

Not a benchmark (no timing here): bench_decode_attention.py times the same launches.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # PYTHONPATH's entries stay first (a baseline tree ahead of this checkout)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks" / "kernels"))

from bench_decode_attention import (  # noqa: E402
    FORMATS,
    HEAD_DIM,
    NUM_HEADS,
    build_cache,
    build_tiered_cache,
    random_vq_calibration,
)

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops.decode.paged import paged_decode_attention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=list(FORMATS),
                   help="tiered: --kernel gluon only (the Triton tiered kernel is not paged_decode_attention); "
                        "vq: on a random calibration, as bench_decode_attention's")
    p.add_argument("--kernel", choices=("triton", "gluon"), default="triton")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    name, options = FORMATS[args.format]
    if name == "vq":
        options = {**options, "calibration": random_vq_calibration()}
    if args.kernel == "gluon":
        run = gluon_attend(name, options, args, device, gen)
    elif name == "tiered":
        p.error("tiered: its Triton kernel is not profiled here; use --kernel gluon")
    else:
        run = triton_paged(name, options, args, device, gen)
    for _ in range(args.repeats):
        run()
        torch.cuda.synchronize()
    print(f"{args.format} ({args.kernel}): {args.repeats} launches at batch {args.batch}, context {args.context}")


def triton_paged(name, options, args, device, gen):
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="triton", **options)  # the Triton kernel reads slabs
    spec = fmt.decode_spec(args.block_size, HEAD_DIM)
    cache, ctx = build_cache(fmt, args.batch, args.context, args.block_size, device, gen)
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    return lambda: paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                          HEAD_DIM ** -0.5, None, spec, block_n=args.block_n,
                                          num_warps=args.num_warps, num_stages=args.num_stages)


def gluon_attend(name, options, args, device, gen):
    # fragment-order pools: KVFormat.attend takes the Gluon kernel
    fmt = get_kv_format(name, torch.bfloat16, decode_kernel="gluon", **options)
    build = build_tiered_cache if name == "tiered" else build_cache
    cache, ctx = build(fmt, args.batch, args.context, args.block_size, device, gen)
    q = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    return lambda: fmt.attend(q, cache, ctx, HEAD_DIM ** -0.5, None)


if __name__ == "__main__":
    main()
