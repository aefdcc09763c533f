#!/bin/bash
# One GPU call for quantization_calibration's GPTQ block by block (models/gptq.round_blockwise) at real
# shapes, random weights (load_format='dummy'), 8,192 random calibration tokens: the engine's start with
# --quantization int4 --quantization-calibration on 2 Mixtral-8x7B layers, then on 1 Mixtral-8x22B layer.
# Each records the seconds of every block, the second-moment bytes alive at most and the device's peak
# allocated memory (benchmarks/quality/bench_gptq_blocks.py). Each step writes its file to $OUT before
# the next starts. Run from the repository root (about 3 minutes on an H100):
#     PYTHONPATH=. bash scripts/gpu/gptq_blocks.sh 2>&1 | tee $OUT/log
# Prediction (H100): second moments at most 7,247,757,312 bytes (8x7B) and 10,099,884,032 (8x22B),
# exactly; 8-12 s a Mixtral-8x7B block and 12-16 s a Mixtral-8x22B block (GPTQ's column loop,
# launch-bound); peak allocated ~20 GB (8x7B, 2 layers) and ~25 GB (8x22B, 1 layer).
source "$(dirname "$0")/preamble.sh" gptq_blocks name,memory.total
timeout 150 python benchmarks/quality/bench_gptq_blocks.py --shape mixtral-8x7b --layers 2 \
  --out "$OUT/gptq_blocks_mixtral-8x7b.json" > "$OUT/gptq_blocks_mixtral-8x7b.log" 2>&1
grep -E "GPTQ|_s\"|bytes" "$OUT/gptq_blocks_mixtral-8x7b.log" | tail -12; el "Mixtral-8x7B, 2 layers"
timeout 120 python benchmarks/quality/bench_gptq_blocks.py --shape mixtral-8x22b --layers 1 \
  --out "$OUT/gptq_blocks_mixtral-8x22b.json" > "$OUT/gptq_blocks_mixtral-8x22b.log" 2>&1
grep -E "GPTQ|_s\"|bytes" "$OUT/gptq_blocks_mixtral-8x22b.log" | tail -12; el "Mixtral-8x22B, 1 layer"
