#!/usr/bin/env python3
"""bench_decode_attention with its launch shapes replaced by a sweep of split counts x L2 prefetch.

The launcher's default (first), then tiles of 64, 4 warps, 2 stages, inline PTX, with
num_splits_for's count times 1, 2, 3 and 4, each with prefetch off and 2 tiles ahead. Every other
option is bench_decode_attention's; fp8's split_factor was chosen with it:

    python benchmarks/kernels/sweep_decode_splits.py --formats fp8_e4m3 --out /tmp/decode_attention_fp8_splits.json

--split-counts N N ... times exactly those split counts instead (prefetch off), e.g. whole waves
of programs per SM (e.g. `--split-counts 4 5 6 8 --shapes 16x32768 --swap-ab 0 1`).
--write-config writes each format's best split factor and prefetch into its device's tuning file
(moekv/ops/configs/decode_attention_<device>.json, see bench_decode_attention.best_launch).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_attention as bench  # noqa: E402

SPLIT_FACTORS = (1, 2, 3, 4)
PREFETCH = (0, 2)

if __name__ == "__main__":
    if "--split-counts" in sys.argv:
        at = sys.argv.index("--split-counts")
        end = next((i for i in range(at + 1, len(sys.argv)) if sys.argv[i].startswith("--")), len(sys.argv))
        counts = [int(n) for n in sys.argv[at + 1:end]]
        bench.COMMAND_ARGV = list(sys.argv)  # the result file's command keeps the counts
        del sys.argv[at:end]
        bench.CONFIGS = [(64, 4, 2, -n, True, 0) for n in counts]
    else:
        bench.CONFIGS = [bench.DEFAULT_CONFIG] + [(64, 4, 2, f, True, pf) for f in SPLIT_FACTORS for pf in PREFETCH]
    bench.main()
