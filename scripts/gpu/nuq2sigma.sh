#!/bin/bash
# One GPU call (about 3 minutes): nuq2's outlier threshold, now 3.0 by default, against its former 3.5
# (and 2.5) on the GPU, as the CPU measured it (docs/decisions.md, "nuq2's outliers beyond 3.0 standard
# deviations"). 1) domain-moe, decode-tail perplexity per held-out domain and passkeys at 1k/2k/4k, every
# row in one run (plain `nuq2` has per-page codebooks: domain-moe's calibration holds vq's only);
# 2) the decode kernels' time at both thresholds (the slots 3.0 fills are read behind the kernels' slot
# branches; bits are unchanged). Run from the repository root:  bash scripts/gpu/nuq2sigma.sh
source "$(dirname "$0")/preamble.sh" nuq2sigma
timeout 150 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 nuq2:kv_outlier_cap=1024 nuq2:kv_outlier_sigma=3.5:kv_outlier_cap=1024 nuq2:kv_outlier_sigma=2.5:kv_outlier_cap=1024 \
  --out "$OUT/domain_moe_nuq2_outlier_sigma.json" > "$OUT/tables.log" 2>&1
grep -v Warn "$OUT/tables.log" | tail -8
timeout 80 python benchmarks/kernels/bench_decode_attention.py --formats nuq2_all_slots nuq2_sigma35 --kernel triton gluon \
  --configs 0 --shapes 1x4096 16x32768 64x32768 --out "$OUT/decode_attention_nuq2_sigma.json" > "$OUT/bench.log" 2>&1
tail -20 "$OUT/bench.log"
