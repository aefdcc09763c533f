#!/bin/bash
# One GPU call (about 3 minutes on an H100): DeepSeek-V2-Lite's batch-1 decode step with MLA's projections and the
# shared experts' through the dense GEMV (layers/attention.project), the RoPE cos / sin computed once a step, MLA's
# rotations, kv_a_layernorm and entry in one launch (ops/mla_rope_norm.py) and the latent written through one
# index_put, against the same benchmark on the tree before (BASELINE_OVERLAY: a folder
# holding main's `moekv`, e.g. `mkdir B && git archive main moekv | tar x -C B`; carry it), same run, same GPU.
#   1. the gpu-marked tests: the latent kernel against float64, the engine's MLA paths (bf16 decode against the
#      fp32 CPU engine, CUDA graphs against eager), mla_rope_norm against its reference and float64, the dense
#      GEMV against F.linear, GLM-4.5 against transformers (its shared expert through the dense GEMV);
#   2. bench_mla_decode --shapes deepseek-v2-lite --kv bf16 fp8_e4m3 --points 1:4096 --profile on this tree;
#   3. the same with PYTHONPATH="$BASELINE_OVERLAY:." (bench_mla_decode keeps PYTHONPATH's order; each JSON names
#      the tree that ran in moekv_tree, printed at the end: the two must differ).
# Prediction (H100; baseline bf16 4.63 ms, 1,133 kernels a step, benchmarks/results/h100/profile_v2lite_b1.txt):
#   tests pass. bf16: 3.4-3.9 ms (~3.6; ~2.2x the 1.67 ms floor) against ~4.6; ~565 kernels a step
#   (count_decode_ops) against ~1,133: the RoPE tables 8 launches x 26 layers fewer (AUnaryFunctor, bfloat16_copy, direct_copy, cos / sin),
#   slot // P and slot % P (BUnaryFunctor<long>, 54) and cuBLAS' split-K reduce (27) gone; the rotation, its
#   concatenations, kv_a_layernorm, the entry's and q's concatenations (~10-11 a layer: CatArrayBatchedCopy,
#   elementwise_kernel, CUDAFunctor_add, _rms_norm_kernel but the final norm's) become one _mla_rope_norm_kernel
#   a layer; the nvjet 64x8 / 2x1 / splitK GEMMs (~160 launches, ~0.95 ms) become _dense_gemv_kernel launches
#   (~0.65 ms for their ~1.66 GB). The two absorbed bmm (nvjet 8x64 TNN, 64x8 NNT) and the LM head stay cuBLAS.
#   fp8_e4m3: the same ~1 ms below its baseline, ~0.1-0.15 ms above bf16 (its quantize ops in the write).
source "$(dirname "$0")/preamble.sh" mlafixed
timeout 60 python -m pytest -q -rf -p no:cacheprovider tests/test_mla_rope_norm.py > "$OUT/gpu_tests.log" 2>&1
timeout 150 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_mla_decode.py tests/test_deepseek.py \
  tests/test_dense_gemv.py >> "$OUT/gpu_tests.log" 2>&1
# GLM-4.5's shared expert and dense first layer take the dense GEMV at one token too (GatedMLP)
timeout 90 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_glm4_moe.py -k cuda_matches_transformers \
  >> "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"; el "gpu tests"
ARGS="--shapes deepseek-v2-lite --kv bf16 fp8_e4m3 --points 1:4096 --profile"
timeout 100 python benchmarks/e2e/bench_mla_decode.py $ARGS --out "$OUT/v2lite_b1.json" > "$OUT/v2lite_b1.log" 2>&1
grep -vE "Warning|_warn_once" "$OUT/v2lite_b1.log"; el "this tree"
if [ -n "$BASELINE_OVERLAY" ] && [ -d "$BASELINE_OVERLAY/moekv" ]; then
  PYTHONPATH="$BASELINE_OVERLAY:." timeout 100 python benchmarks/e2e/bench_mla_decode.py $ARGS \
    --out "$OUT/v2lite_b1_baseline.json" > "$OUT/v2lite_b1_baseline.log" 2>&1
  grep -vE "Warning|_warn_once" "$OUT/v2lite_b1_baseline.log"; el "baseline"
fi
grep -h '"moekv_tree"' "$OUT"/v2lite_b1*.json  # the two runs must name different trees
