#!/bin/bash
# One GPU call (about 5 minutes on an H200; under 8 on an H100) for what the CPU decided from the H200's
# timings without a GPU to check it, then GLM-4.5-Air's decode row, which that run did not reach:
# 1. the three GPU tests mended on the CPU (the sinks' 'not vacuous' bound, the tiered kernel with sinks, the
#    MXFP4 code test) and the quantized kernels' tests (default_path by reuse);
# 2. the Mixtral-shaped decode step, 16 layers, bf16 / fp8 / int4 weights at batch 1, 8, 16 (batch 8 takes the
#    grouped GEMM, int4 the run GEMV, where it took the pair GEMV). Prediction (H200): batch 8 bf16 ~10.6 ms
#    (was 14.01), fp8 ~8.2 (was 11.66), int4 ~11.6 (was 12.43); batch 1 and 16 unchanged but int4 and fp8's
#    batch 1 a little faster with the projection GEMV's tiles (2.1 and 2.3 ms);
# 3. the MLA decode steps with the launch table's 64-token tiles (V2-Lite batch 1: 4.20 ms with 32-token
#    tiles; predicted 3.6-4.1) and the kernel table of n64 beside n64f8 (fp8 MMAs: predicted 0.8-1.1x n64);
# 4. GLM-4.5-Air (first 10 layers) at (1, 4k) and (32, 32k) per KV format against the floor;
# 5. domain-moe's batch-64 engine step without and with a regex, the grammar's host parts a step (last: it
#    puts the carried wheels on PYTHONPATH).
# Each step writes its file to $OUT before the next starts. Carry `wheels` (xgrammar for step 4).
# Run from the repository root:  bash scripts/gpu/paths_mla_glm.sh
source "$(dirname "$0")/preamble.sh" paths_mla_glm name,memory.total
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 120 python -m pytest -q -rf -p no:cacheprovider $PARALLEL tests/test_quant_kernels.py \
  "tests/test_attention_sinks.py::test_sinks_change_the_kernel_output" \
  "tests/test_attention_sinks.py::test_tiered_kernel_with_sinks" \
  "tests/test_mxfp4_kernels.py::test_every_code_and_scale_through_the_gemv" > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; el "mended tests and quantized kernels"
timeout 90 python benchmarks/e2e/bench_decode.py --random-weights --weights bf16 fp8 int4 --formats bf16 \
  --points 1:4096 8:4096 16:4096 --num-layers 16 --no-transformers \
  --out "$OUT/decode_wquant.json" | grep -E "TPOT|skipped|GiB|bandwidth"; el "decode rows (16 layers)"
timeout 60 python benchmarks/e2e/bench_mla_decode.py --kv bf16 fp8_e4m3 int4 --out "$OUT/mla_e2e.json" \
  > "$OUT/mla_e2e.log" 2>&1; tail -6 "$OUT/mla_e2e.log"
timeout 60 python benchmarks/kernels/bench_mla_decode.py --shapes 64x32768x128 1x4096x128 --block-h default \
  --configs n64 n64f8 --out "$OUT/mla_decode_fp8_mma.json" > "$OUT/mla_decode_fp8_mma.log" 2>&1
tail -4 "$OUT/mla_decode_fp8_mma.log"; el "MLA steps and fp8 MMAs"
timeout 150 python benchmarks/e2e/bench_decode.py --random-weights --shape glm-4.5-air-10l --points 1:4096 32:32768 \
  --formats bf16 fp8_e4m3 nuq2 int4 kivi2 tiered --iters 10 --no-transformers --out "$OUT/decode_glm45air10l.json" \
  2>&1 | grep -E "TPOT|skipped|GiB"; el "GLM-4.5-Air decode row"
if [ -d wheels ]; then source scripts/gpu/wheels_env.sh; fi
timeout 90 python benchmarks/e2e/bench_grammar_mask.py --engine --batch 64 --steps 200 --device cuda \
  --out "$OUT/grammar_engine_cuda.json" 2>&1 | tail -1 | cut -c1-600; el "grammar engine step"
