#!/bin/bash
# One GPU call for gpt-oss (GptOssForCausalLM): the attention sinks in every format's decode kernels
# (Gluon at head_dim 128 / pages of 64, Triton at gpt-oss's head_dim 64), the fused MoE's bias and
# clamped-SwiGLU epilogues compiled, the gpt-oss tests on CUDA (bf16 decode steps from CUDA graphs
# against eager, fp32 logits against transformers), the tiered reduce's GPU tests (its merge takes the
# sinks), then a gpt-oss-20b-shaped decode row (random bf16 weights). Each step writes its file to
# $OUT before the next starts. Run from the repository root (under 4 minutes):
#     PYTHONPATH=. bash scripts/gpu/gptoss.sh 2>&1 | tee $OUT/log
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:=/tmp/gptoss}"; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/test_attention_sinks.py tests/test_fused_moe_gpt_oss.py \
  tests/test_gpt_oss.py > "$OUT/gpu_tests_gptoss.log" 2>&1
tail -3 "$OUT/gpu_tests_gptoss.log"; el "gpt-oss tests"
timeout 60 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_decode_tiered.py \
  tests/test_gluon_tiered_decode.py > "$OUT/gpu_tests_tiered.log" 2>&1
tail -3 "$OUT/gpu_tests_tiered.log"; el "tiered reduce tests"
timeout 90 python benchmarks/e2e/bench_decode.py --random-weights --shape gpt-oss-20b --formats bf16 fp8_e4m3 nuq2 \
  --points 1:4096 32:32768 --iters 10 --no-transformers --out "$OUT/decode_gpt_oss_20b.json" | grep -E "TPOT|skipped|GiB"
el "gpt-oss-20b decode row"
