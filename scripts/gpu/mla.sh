#!/bin/bash
# One GPU call (< 4 min on an H100 / H200) for multi-head latent attention: the gpu-marked tests of the
# absorbed decode kernel against float64 and of the engine's kernel path against the CPU reference, then
# the kernel's timings at (64, 32k) and (1, 4k) beside the latent cache's byte floor (bytes read / the
# copy bandwidth measured in the same run), bf16 and fp8 latents; then whole decode steps of a
# DeepSeek-V2-Lite-shaped model and of a DeepSeek-V3-shaped layer stack (random weights, CUDA graphs)
# beside their floors, V3's projected to the whole model. Each step writes its file to $OUT before the
# next starts.   Run from the repository root:  bash scripts/gpu/mla.sh
source "$(dirname "$0")/preamble.sh" mla_gpu
timeout 120 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_mla_decode.py tests/test_deepseek.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; el "gpu tests"
timeout 60 python benchmarks/kernels/bench_mla_decode.py --block-h default 16 64 --out "$OUT/mla_decode.json" \
  | tee "$OUT/mla_decode.log"
el "kernel table"
timeout 90 python benchmarks/e2e/bench_mla_decode.py --out "$OUT/mla_e2e.json" | tee "$OUT/mla_e2e.log"
el "decode steps"
