#!/usr/bin/env python3
"""Launch shapes of the batch-1 decode step, chosen on the whole step rather than on each kernel
alone (a micro-benchmark of a 34-50 MB projection partly runs from the 50 MB L2; in the model it
never does). One random-weight Mixtral-8x7B-shaped model, bf16 KV, batch 1, context 4096, CUDA
graph replays (bench_decode.run_point); three stages, each keeping the best of the one before:

  A. the MoE decode GEMV's launch shape (fused_moe.DEFAULT_GEMV)
  B. the attention projections' GEMV shape (dense_gemv.DEFAULT_SHAPE)
  C. programmatic dependent launch (MOEKV_PDL=1) with 0, 1 or 2 K tiles prefetched before waiting

    PYTHONPATH=. python benchmarks/e2e/sweep_decode_b1.py --out benchmarks/results/h200/sweep_decode_b1.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402

from moekv.ops import dense_gemv as dg  # noqa: E402
from moekv.ops import fused_moe as fm
from moekv.ops import pdl

MOE_SHAPES = [fm.GemvConfig(block_n=32, block_k=256, num_stages=3, row_sums=False),  # the first default
              fm.GemvConfig(block_n=16, block_k=512, row_sums=False),  # the second
              fm.GemvConfig(block_n=16, block_k=1024), fm.GemvConfig(block_n=8, block_k=512)]  # row sums
DENSE_SHAPES = [dg.GemvShape(16, 512, 4), dg.GemvShape(8, 2048, 8), dg.GemvShape(2, 4096, 4)]

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=40)
    args = p.parse_args()
    dev = torch.device("cuda")
    bandwidth = bd.measure_bandwidth(dev)
    model, cfg = bd.build_random_model("mixtral-8x7b", dev)
    free = torch.cuda.mem_get_info(dev)[0] - bd.ACTIVATION_RESERVE
    rows = []

    def measure(stage: str, label: str) -> float:
        row = bd.run_point(model, cfg, "bf16", 1, 4096, dev, bandwidth, free, args.iters)
        rows.append(dict(stage=stage, variant=label, moe=vars(fm.DEFAULT_GEMV), dense=vars(dg.DEFAULT_SHAPE),
                         pdl=pdl.pdl_enabled(dev), prefetch_tiles=pdl.PREFETCH_TILES,
                         tpot_ms=row["tpot_ms"], floor_ms=row["floor_ms"], graph=row["graph"]))
        print(f"{stage} {label:<40} TPOT {row['tpot_ms']:.3f} ms (floor {row['floor_ms']:.2f})", flush=True)
        return row["tpot_ms"]

    measure("defaults", "moe / dense / PDL defaults")  # GemvConfig(), GemvShape(), PDL on, no prefetch
    default_moe, default_dense = fm.DEFAULT_GEMV, dg.DEFAULT_SHAPE
    for c in MOE_SHAPES:
        fm.DEFAULT_GEMV = c
        measure("moe", f"moe {c}")
    fm.DEFAULT_GEMV = default_moe
    for s in DENSE_SHAPES:
        dg.DEFAULT_SHAPE = s
        measure("dense", f"dense {s}")
    dg.DEFAULT_SHAPE = default_dense
    os.environ["MOEKV_PDL"] = "0"
    measure("pdl", "PDL off")
    os.environ.pop("MOEKV_PDL")
    pdl.PREFETCH_TILES = 1
    measure("pdl", "PDL, prefetch 1 K tile")
    pdl.PREFETCH_TILES = 0
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.date.today().isoformat(), command="PYTHONPATH=. python " + " ".join(sys.argv),
                  hbm_copy_bandwidth_bytes_per_s=bandwidth, rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
