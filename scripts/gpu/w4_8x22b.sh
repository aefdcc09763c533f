#!/bin/bash
# One GPU call on an H200 (needs ~100 GiB of GPU memory: run with needs_h200) for issue 47's headline load:
# a Mixtral-8x22B-shaped model (56 layers, random weights built quantized, never a 16-bit copy: ~70 GiB at
# int4) with nuq2, tiered and int4 KV caches, batch 1 and 128 sequences at 4k, CUDA graphs, each point against
# its floor (bench_decode). fp8 weights (131 GiB) do not fit beside a cache. Under 4 minutes:
#     PYTHONPATH=. bash scripts/gpu/w4_8x22b.sh 2>&1 | tee $OUT/log
# Prediction: batch-1 floor ~4.8 ms (20 GiB of int4 weights a step at ~4.3 TB/s), TPOT 1.6-2.0x it (the
# Mixtral-8x7B shape's int4 step is 1.85x on an H100); batch 128: every expert read (~70 GiB, ~17 ms floor),
# TPOT 2-2.6x its floor (the grouped GEMM reads int4 no faster than bf16).
source "$(dirname "$0")/preamble.sh" w4_8x22b name,memory.total
timeout 400 python benchmarks/e2e/bench_decode.py --random-weights --shape mixtral-8x22b --weights int4 \
  --formats nuq2 tiered int4 --points 1:4096 128:4096 --iters 10 --no-transformers \
  --out "$OUT/decode_mixtral_8x22b_int4.json" 2>&1 | grep -v Warn | tail -12
