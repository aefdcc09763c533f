#!/usr/bin/env python3
"""The small kernels of a batch-1 decode step, each beside its baseline and its floor (bytes read /
measured copy bandwidth), at the Mixtral-8x7B shape (hidden 4096, 32/8 heads of 128, 8 experts),
timed as CUDA-graph replays (launch cost included, as in the engine):

- attention projections (qkv 6144 x 4096, o 4096 x 4096): cuBLAS (F.linear) vs ops/dense_gemv.py
  launch shapes, T = 1 and 4, over 8 distinct weights (no L2 reuse, as in a model's layers);
- router logits (8 x 4096): cuBLAS vs ops/router_gemv.py (one expert per program, or all per program);
- residual add + RMSNorm: two launches vs ops/rms_norm.add_rms_norm;
- paged decode attention (bf16 KV, batch 1, 4k / 32k / 128k): the split count and tile width.

    PYTHONPATH=. python benchmarks/kernels/bench_decode_step_kernels.py \
        --out benchmarks/results/h200/decode_step_kernels.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_attention as bda  # noqa: E402

from moekv.kvcache.formats import get_kv_format  # noqa: E402
from moekv.ops import dense_gemv as dg  # noqa: E402
from moekv.ops.decode.launch import num_splits_for  # noqa: E402
from moekv.ops.decode.paged import paged_decode_attention  # noqa: E402
from moekv.ops.reference import rms_norm_ref  # noqa: E402
from moekv.ops.rms_norm import add_rms_norm, rms_norm  # noqa: E402
from moekv.ops.router_gemv import router_gemv  # noqa: E402

H, HQ, HKV, D, E = 4096, 32, 8, 128, 8
COPIES = 8  # distinct weights per timed projection: 8 x 34-50 MB, well past the L2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = bda.measure_bandwidth(dev)  # bytes/s
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def record(kernel, impl, ms, nbytes, err=None, **extra):
        row = dict(kernel=kernel, impl=impl, us=ms * 1e3, floor_us=nbytes / bw * 1e6, bytes=nbytes,
                   frac_of_floor=nbytes / bw / (ms * 1e-3), max_rel_err=err, **extra)
        rows.append(row)
        print(f"{kernel:>12} {impl:<34} {row['us']:8.2f} us  floor {row['floor_us']:7.2f} us "
              f"({row['frac_of_floor']:.2f})" + (f"  err {err:.1e}" if err is not None else ""), flush=True)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # projections: each timed over COPIES distinct weights (one launch per copy, time divided by
    # COPIES), so that a 34-50 MB weight is not served from the 50 MB L2 as one reused copy would be
    for name, N in (("qkv", HQ * D + 2 * HKV * D), ("o", H)):
        ws = [(torch.randn(N, H, device=dev, generator=gen) / 64).bfloat16() for _ in range(COPIES)]
        for T in (1, 4):
            x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
            ref = F.linear(x, ws[0])
            nbytes = N * H * 2

            def each(fn):
                return lambda: [fn(w) for w in ws]
            record(name, "cublas", bda.timer(each(lambda w: F.linear(x, w)), True) / COPIES, nbytes, tokens=T)
            for bn in (8, 16, 32):
                for bk in (256, 512, 1024):
                    for warps in (4, 8):
                        if bn * bk > 64 * 32 * warps:  # keep the fp32 tile near 64 registers a thread
                            continue
                        shape = dg.GemvShape(bn, bk, warps, 3)
                        out = dg.dense_gemv(x, ws[0], shape=shape)
                        ms = bda.timer(each(lambda w, shape=shape: dg.dense_gemv(x, w, shape=shape)), True) / COPIES
                        record(name, f"dense_gemv bn{bn} bk{bk} w{warps}", ms, nbytes, rel(out, ref), tokens=T,
                               block_n=bn, block_k=bk, num_warps=warps)
        ws = None  # free the copies (rebound, not del: the timed lambdas close over ws)

    # router
    gate = (torch.randn(E, H, device=dev, generator=gen) / 64).bfloat16()
    x = torch.randn(1, H, device=dev, generator=gen).bfloat16()
    ref = F.linear(x, gate)
    record("router", "cublas", bda.timer(lambda: F.linear(x, gate), True), E * H * 2)
    for be in (1, 2, 8):
        out = router_gemv(x, gate, block_e=be)
        record("router", f"router_gemv block_e{be}", bda.timer(lambda be=be: router_gemv(x, gate, block_e=be), True),
               E * H * 2, rel(out, ref), block_e=be)

    # residual add + RMSNorm
    xs, delta = (torch.randn(1, H, device=dev, generator=gen).bfloat16() for _ in range(2))
    wn = torch.ones(H, device=dev).bfloat16()
    ref = rms_norm_ref(xs + delta, wn, 1e-5)
    record("add_norm", "add + rms_norm", bda.timer(lambda: rms_norm(xs + delta, wn, 1e-5), True), 3 * H * 2 * 2)
    record("add_norm", "add_rms_norm", bda.timer(lambda: add_rms_norm(xs, delta, wn, 1e-5), True), 3 * H * 2,
           rel(add_rms_norm(xs, delta, wn, 1e-5)[1], ref))

    # decode attention, bf16, batch 1 (pages of 16: the engine's default for bf16; of 64: the compressed formats')
    fmt = get_kv_format("bf16", torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for context, P in ((4096, 16), (4096, 64), (32768, 64), (131072, 64)):
        spec = fmt.decode_spec(P, D)
        cache, ctx = bda.build_cache(fmt, 1, context, P, dev, gen)
        q = torch.randn(1, HQ, D, device=dev, dtype=torch.bfloat16, generator=gen)
        nbytes = 2 * context * HKV * D * 2
        ref = paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots, D ** -0.5, None, spec)
        default = num_splits_for(1, HKV, context, 64, sms)
        for block_n in (32, 64):
            for splits in sorted({8, 16, 32, 64, 128, default}):
                if splits * block_n > context:
                    continue

                def run(splits=splits, block_n=block_n):
                    return paged_decode_attention(q, cache, ctx.block_tables, ctx.context_lens, ctx.seq_slots,
                                                  D ** -0.5, None, spec, num_splits=splits, block_n=block_n)
                label = (f"ctx{context} P{P} bn{block_n} splits{splits}"
                         + (" (default)" if splits == default and block_n == 64 else ""))
                record("attn_b1", label, bda.timer(run, True), nbytes, rel(run(), ref), context=context, block_size=P,
                       block_n=block_n, num_splits=splits)
        cache = None  # free the cache (rebound, not del: run() closes over it)

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="PYTHONPATH=. python " + " ".join(sys.argv), copy_gbps=bw / 1e9, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
