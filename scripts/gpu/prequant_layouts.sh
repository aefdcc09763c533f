#!/bin/bash
# One GPU call for the pre-quantized checkpoint layouts (compressed-tensors FP8, AWQ, GPTQ: converted on
# load to the fp8 / int4 QuantizedWeights): their GPU test (converted on the GPU, read by the quantized
# kernels in bf16 with AWQ / GPTQ's fp16 scales, against the CPU engine in fp32), then the quantized
# kernels' own GPU tests. Each step writes its file to $OUT before the next starts. Run from the
# repository root (under 4 minutes):
#     PYTHONPATH=. bash scripts/gpu/prequant_layouts.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" prequant_layouts name,memory.total
timeout 120 python -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_prequantized_layouts.py \
  > "$OUT/gpu_tests_prequant_layouts.log" 2>&1
tail -8 "$OUT/gpu_tests_prequant_layouts.log"; el "pre-quantized layouts on CUDA"
timeout 90 python -m pytest -q -m gpu -n 4 -rf -p no:cacheprovider tests/test_quant_kernels.py \
  > "$OUT/gpu_tests_quant_kernels.log" 2>&1
tail -3 "$OUT/gpu_tests_quant_kernels.log"; el "quantized kernel tests"
