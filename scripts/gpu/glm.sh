#!/bin/bash
# One GPU call (< 4 min on an H100 / H200) for GLM-4.5 (Glm4MoeForCausalLM): the gpu-marked tests of
# partial RoPE (the RoPE kernel and the fused RoPE + KV write against the unfused path) and of GLM
# checkpoints on CUDA (float32 against transformers, bf16 with GLM's head geometry through every
# format's decode kernels and graphs), then bench_decode's GLM-4.5-Air shape (its first 10 layers,
# random bf16 weights) at (1, 4k) and (32, 32k) per KV format beside the bytes floor. Each step writes
# its file to $OUT before the next starts.   Run from the repository root:  bash scripts/gpu/glm.sh
source "$(dirname "$0")/preamble.sh" glm_gpu
timeout 60 python -m pytest -q -rf -p no:cacheprovider tests/test_norm_rotary_kernels.py \
  tests/test_rope_kv_write.py > "$OUT/gpu_tests_rope.log" 2>&1
tail -3 "$OUT/gpu_tests_rope.log"; el "rope tests"
timeout 110 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_glm4_moe.py > "$OUT/gpu_tests_glm.log" 2>&1
tail -3 "$OUT/gpu_tests_glm.log"; el "glm tests"
timeout 150 python benchmarks/e2e/bench_decode.py --random-weights --shape glm-4.5-air-10l --points 1:4096 32:32768 \
  --formats bf16 fp8_e4m3 nuq2 int4 kivi2 tiered --iters 10 --no-transformers --out "$OUT/decode_glm45air10l.json" \
  2>&1 | grep -v Warn | tee "$OUT/decode_glm45air10l.log"
el "bench_decode"
