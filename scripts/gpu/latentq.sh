#!/bin/bash
# One GPU call (< 4 min on an H100 / H200) for the low-bit latent caches (kvcache/formats/latent_lowbit.py):
# the gpu-marked tests of the int4 latent's Triton kernel against float64 at DeepSeek-V3's shape (and the
# bf16 / fp8 ones beside it), the kernel table with the int4 latent beside bf16 and fp8 at (64, 32k) and
# (1, 4k) against the byte floor, then decode steps of the V2-Lite-shaped model and the V3 layer stack with
# each latent (CUDA graphs), then, when models/domain-mla holds a checkpoint, its perplexity per domain
# (decode-tail) for every latent format and the 2-bit windows, the CPU table's command (docs/quality.md, "The
# latent cache formats on domain-mla (CPU)") on the GPU in bf16. Each step writes its file to $OUT before
# the next starts.   Run from the repository root:  bash scripts/gpu/latentq.sh
source "$(dirname "$0")/preamble.sh" latentq_gpu
timeout 120 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_mla_latent_lowbit.py tests/test_mla_decode.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; el "gpu tests"
timeout 60 python benchmarks/kernels/bench_mla_decode.py --shapes 64x32768x128 1x4096x128 --block-h default \
  --out "$OUT/mla_decode_int4.json" | tee "$OUT/mla_decode_int4.log"
el "kernel table"
timeout 60 python benchmarks/e2e/bench_mla_decode.py --kv bf16 fp8_e4m3 int4 --out "$OUT/mla_e2e_int4.json" \
  | tee "$OUT/mla_e2e_int4.log"
el "decode steps"
if ls models/domain-mla/*.safetensors > /dev/null 2>&1; then
  timeout 150 python benchmarks/quality/domain_model_tables.py --device cuda --model models/domain-mla \
    --ppl-mode decode-tail --tail-windows 2 --lengths 4096 --no-retrieval \
    --formats bf16 fp8_e4m3 int4 int4:kv_group_size=64 kivi2 kivi2:kv_residual=32 nuq2 nuq2:kv_residual=32 fp32 \
    --out "$OUT/domain_mla_latents.json" 2>&1 | tail -12 | tee "$OUT/domain_mla_latents.log"
  el "domain-mla latents"
else
  echo "models/domain-mla has no checkpoint yet: its latent table is skipped" | tee "$OUT/domain_mla_latents.log"
fi
