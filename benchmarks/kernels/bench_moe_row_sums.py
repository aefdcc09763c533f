#!/usr/bin/env python3
"""The MoE decode GEMV with and without row sums per K step (GemvConfig.row_sums), Mixtral-8x7B
experts, T = 1 and 4, CUDA-graph replays, beside the weight-bytes floor at copy bandwidth;
rel_err_vs_default is against the first config (the fp32-tile accumulator).

    PYTHONPATH=. python benchmarks/kernels/bench_moe_row_sums.py --out benchmarks/results/h200/moe_row_sums.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # PYTHONPATH's entries first (a baseline tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe import measure_hbm_gbps  # noqa: E402

from moekv.ops import fused_moe as fm  # noqa: E402

# the first: the fp32-tile accumulator at 16 x 512 tiles, the baseline the row sums are timed against
CONFIGS = [fm.GemvConfig(block_n=16, block_k=512, row_sums=False)] + [
    fm.GemvConfig(block_n=bn, block_k=bk, row_sums=True) for bn, bk in ((16, 512), (16, 1024), (32, 512), (8, 1024))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    E, H, I, k = 8, 4096, 14336, 2
    bw = measure_hbm_gbps() * 1e9  # bytes/s of a 1 GiB copy, as bench_moe.py measures it
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
    rows = []
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(T)])
        weights = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1)
        touched = int(ids.unique().numel())
        floor_ms = touched * 3 * H * I * 2 / bw * 1e3
        ref = fm.fused_moe(x, w13, w2, weights, ids, config=CONFIGS[0])
        for cfg in CONFIGS:
            out = fm.fused_moe(x, w13, w2, weights, ids, config=cfg)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = do_bench_cudagraph(lambda cfg=cfg: fm.fused_moe(x, w13, w2, weights, ids, config=cfg), rep=100,
                                    return_mode="median")
            rows.append(dict(tokens=T, config=vars(cfg), ms=ms, floor_ms=floor_ms, frac_of_floor=floor_ms / ms,
                             rel_err_vs_default=err))
            print(f"T={T} {cfg} {ms:.4f} ms ({floor_ms / ms:.3f} of floor) err {err:.1e}", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), command="PYTHONPATH=. python " + " ".join(sys.argv),
                  copy_bandwidth_bytes_per_s=bw, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
