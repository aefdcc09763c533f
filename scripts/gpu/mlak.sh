#!/bin/bash
# One GPU call (~3 min on an H100 / H200, under 4) for the absorbed MLA decode's launch table (ops/decode/mla.py,
# moekv/ops/configs/mla_decode_<device>.json): the gpu-marked tests of the latent kernels against float64 at
# DeepSeek-V3's shape for the table's launch and each named config (bf16, fp8, int4 latents); the kernel table at
# (64, 32k), (16, 32k) and (1, 4k), 128 heads, for the three latents with the table's launch beside the previous
# one (config v1: 32-token tiles), 64-token tiles (n64), transposed scores (swap128) and n64 with fp8 MMAs on the fp8
# latent (n64f8: queries and probabilities in e4m3), each against the byte floor; then decode steps of the
# V2-Lite-shaped model and the V3 layer stack (CUDA graphs, the table's launch).
# Prediction for n64f8 (offline build: 453 local accesses, spills inside the loop, half the tensor instructions of n64):
# its gpu test passes (error a few percent of max |value| against the 6.4% bound); on the fp8 latent at (64, 32k)
# 0.8-1.1x n64's speed, not the 1.7x over bf16 issue 49 asks; at (1, 4k) slower than n64 by the ~10 us of
# quantize_queries' torch launches.
# Each step writes its file to $OUT before the next starts.   Run from the repository root:  bash scripts/gpu/mlak.sh
source "$(dirname "$0")/preamble.sh" mlak_gpu
timeout 100 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_mla_decode.py tests/test_mla_latent_lowbit.py \
  -k "deepseek_shape" > "$OUT/gpu_tests.log" 2>&1
tail -5 "$OUT/gpu_tests.log"; el "gpu tests"
timeout 140 python benchmarks/kernels/bench_mla_decode.py --shapes 64x32768x128 16x32768x128 1x4096x128 \
  --block-h default --configs default v1 n64 swap128 n64f8 --out "$OUT/mla_decode_configs.json" \
  | tee "$OUT/mla_decode_configs.log"
el "kernel table"
timeout 60 python benchmarks/e2e/bench_mla_decode.py --kv bf16 fp8_e4m3 int4 --out "$OUT/mla_e2e.json" \
  | tee "$OUT/mla_e2e.log"
el "decode steps"
