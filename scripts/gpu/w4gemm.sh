#!/bin/bash
# One GPU call for the swap-AB grouped GEMM (fused_moe_quant path "gemm_swap": the dequantized weight tile the
# wgmma's A operand from registers, the pairs its N; issue 47): the GPU tests of the quantized kernels that take
# it (Mixtral-8x7B shapes at T = 1 8 64 with fp8 / int4, CUDA-graph capture at T = 64, gpt-oss-20b's MXFP4 experts
# with its epilogue), then the grouped GEMM and its swap-AB form side by side (bench_moe_quant --path gemm
# gemm_swap, the same routing for both) at Mixtral-8x7B's and Mixtral-8x22B's expert shapes, T = 16 64 128 256,
# bf16 (gemm only) / fp8 / int4, each row with its weight-byte floor. Each step writes under $OUT before the
# next starts. Under 4 minutes on an H100:
#     PYTHONPATH=. bash scripts/gpu/w4gemm.sh 2>&1 | tee $OUT/log
#
# Prediction (fraction of the byte floor, frac_of_floor; Mixtral-8x22B, H100; the old int4 GEMM read at
# 0.16-0.23 at Mixtral-8x7B's shape on an H200, docs/decisions.md "Mixtral-8x22B at int4 on one H200"):
#   int4  gemm 0.15-0.25 at T = 64 / 128 / 256; gemm_swap 0.25-0.35 at T = 64, 0.28-0.40 at T = 128 and 256
#         (1.3-1.8x: 0.53 against 0.60 warp instructions a weight byte a K step in the sm_90 build, and one
#         64-pair block an expert where the old form's 32-pair blocks decode an expert's tiles 1.5-2 times; still
#         issue-bound, the unpack's fp32 arithmetic is two thirds of a step).
#   fp8   gemm 0.45-0.70; gemm_swap within 0.9-1.2x of it (0.18 against 0.16-0.21 warp instructions a byte: not
#         issue-bound either way; the swap's T = 128 / 256 ahead by its wider blocks, T = 16 / 64 even).
#   bf16  gemm only, the reference row.
#   Mixtral-8x7B the same fractions within ~0.05. T = 16 (2 pairs an expert): both forms ~even.
source "$(dirname "$0")/preamble.sh" w4gemm name,memory.total
timeout 80 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_quant_kernels.py tests/test_mxfp4_kernels.py \
  -k "gemm_swap" > "$OUT/gpu_tests_w4gemm.log" 2>&1
tail -3 "$OUT/gpu_tests_w4gemm.log"; el "gemm_swap GPU tests"
timeout 70 python benchmarks/kernels/bench_moe_quant.py --shape mixtral-8x7b --tokens 16 64 128 256 \
  --weights bf16 fp8 int4 --path gemm gemm_swap --out "$OUT/moe_quant_swap_8x7b.json" > "$OUT/moe_quant_swap_8x7b.log" 2>&1
grep -E "moe|bandwidth|Error" "$OUT/moe_quant_swap_8x7b.log"; el "Mixtral-8x7B gemm / gemm_swap"
timeout 90 python benchmarks/kernels/bench_moe_quant.py --shape mixtral-8x22b --tokens 16 64 128 256 \
  --weights bf16 fp8 int4 --path gemm gemm_swap --out "$OUT/moe_quant_swap_8x22b.json" > "$OUT/moe_quant_swap_8x22b.log" 2>&1
grep -E "moe|bandwidth|Error" "$OUT/moe_quant_swap_8x22b.log"; el "Mixtral-8x22B gemm / gemm_swap"
