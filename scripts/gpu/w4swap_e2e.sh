#!/bin/bash
# One GPU call (about 2 minutes): the decode step with int4 experts where their grouped GEMM takes the transposed
# form by default (fused_moe_quant.default_path: "gemm_swap" for int4 past GEMV_MAX_PAIRS), against the same
# benchmark on the tree before that default (BASELINE_OVERLAY: a folder holding that tree's `moekv`, e.g.
# `mkdir B && git archive <commit> moekv | tar x -C B`; carry it), same run, same GPU.
# Mixtral-8x7B's first 16 layers, random int4 weights, bf16 KV, batch 1 / 16 / 64 at 4k.
# Prediction (H100; kernel table h100/moe_quant_swap_8x7b.json: 0.11 / 0.37 ms saved a layer at T = 16 / 64):
# batch 1 unchanged (the pair GEMV), batch 16 ~12.9 -> ~11.2 ms, batch 64 ~6 ms faster a step (16 layers).
source "$(dirname "$0")/preamble.sh" w4swap_e2e
ARGS="--random-weights --weights int4 --formats bf16 --points 1:4096 16:4096 64:4096 --num-layers 16 --no-transformers"
PYTHONPATH=. timeout 150 python benchmarks/e2e/bench_decode.py $ARGS --out "$OUT/decode_int4_swap.json" 2>&1 \
  | grep -E "TPOT|skipped|GiB"
if [ -n "$BASELINE_OVERLAY" ] && [ -d "$BASELINE_OVERLAY/moekv" ]; then
  PYTHONPATH="$BASELINE_OVERLAY:." timeout 150 python benchmarks/e2e/bench_decode.py $ARGS \
    --out "$OUT/decode_int4_gemm.json" 2>&1 | grep -E "TPOT|skipped|GiB"
fi
grep -h '"moekv_tree"' "$OUT"/decode_int4_*.json  # the two runs must name different trees
