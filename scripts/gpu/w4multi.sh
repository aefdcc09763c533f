#!/bin/bash
# One GPU call for the run GEMV (fused_moe_quant path "runs": each program decodes an expert's weight tiles
# once for up to P of the pairs routed to it): the quantized kernels' GPU tests (Mixtral-8x7B shapes with
# paths None / gemm / gemv / runs, CUDA-graph capture of the run GEMV's sort and kernels) and the mxfp4 ones;
# the MoE step at T = 1 2 4 8 16 64 with the pair GEMV, the run GEMV and the grouped GEMM side by side
# against the weight-byte floor (bench_moe_quant, bf16 / fp8 / int4, the same routing for every path);
# the decode step of a Mixtral-8x7B-shaped model (16 layers, bf16 KV at 4k, random weights) with bf16 /
# fp8 / int4 weights at batch 1, 8 and 16 (bench_decode; path None takes the run GEMV at batch 8, T*k = 16, where
# runs average 2 pairs). Each step writes under $OUT before the next starts. Under 4 minutes on an H100:
#     PYTHONPATH=. bash scripts/gpu/w4multi.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" w4multi name,memory.total
timeout 75 python -m pytest -q -m gpu -n 4 -rf -p no:cacheprovider tests/test_quant_kernels.py tests/test_mxfp4_kernels.py \
  > "$OUT/gpu_tests_w4multi.log" 2>&1
tail -3 "$OUT/gpu_tests_w4multi.log"; el "quantized kernel tests"
timeout 140 python benchmarks/kernels/bench_moe_quant.py --tokens 1 2 4 8 16 64 --path gemv runs gemm \
  --proj-tiles 4x1024 8x1024 16x1024 8x512 16x512 4x2048 --out "$OUT/moe_quant_runs.json" > "$OUT/moe_quant_runs.log" 2>&1
grep -E "moe|qkv|bandwidth|Error" "$OUT/moe_quant_runs.log"
el "MoE paths side by side"
timeout 60 python benchmarks/e2e/bench_decode.py --random-weights --weights bf16 fp8 int4 --formats bf16 \
  --points 1:4096 8:4096 16:4096 --num-layers 16 --no-transformers \
  --out "$OUT/decode_w4multi.json" | grep -E "TPOT|skipped|GiB|bandwidth"
el "decode rows (16 layers)"
