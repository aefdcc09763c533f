#!/bin/bash
# One GPU call that checks the engine on a CUDA machine after a change of its rooms: the gpu-marked
# tests of the engine and of every Gluon kernel, the Gluon kernel table against a baseline tree timed
# in the same call, and the domain-moe KV table as generation reads the cache. Each step writes its
# file to $OUT before the next starts, so a call cut short keeps what finished.
#
# BASELINE=DIR: a checkout of the commit to compare with (e.g. `git worktree add DIR COMMIT`, copied
# into a git-ignored folder of this checkout and carried); without it the kernel table runs once.
# Run from the repository root:  bash scripts/device_check.sh 2>&1 | tee $OUT/log
# The whole check outlasts one 10-minute command: STEPS=tests runs the two test sets, STEPS=tables the
# kernel and quality tables (default: both).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:=/tmp/device_check}"; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${STEPS:-all}" != tables ]; then
timeout 240 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gluon_engine.py tests/test_cuda_graphs.py \
  tests/test_kv_throwaway_format.py tests/test_decode_kernel_choice.py tests/test_kv_prefill_exact.py \
  tests/test_engine_stats.py tests/test_async_scheduling.py tests/test_gpu.py > "$OUT/gpu_tests_engine.log" 2>&1
tail -3 "$OUT/gpu_tests_engine.log"; el "engine tests"
timeout 300 python -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/test_gluon_nuq2_decode.py \
  tests/test_gluon_kivi2_decode.py tests/test_gluon_int4_decode.py tests/test_gluon_fp8_decode.py \
  tests/test_gluon_vq_decode.py tests/test_gluon_tiered_decode.py > "$OUT/gpu_tests_gluon.log" 2>&1
tail -3 "$OUT/gpu_tests_gluon.log"; el "gluon tests"
fi
[ "${STEPS:-all}" = tests ] && exit 0
TABLE=(--formats nuq2 kivi2 int4 vq tiered --kernel gluon --shapes 16x32768 64x32768 1x131072 1x4096 --configs 0)
timeout 150 python benchmarks/kernels/bench_decode_attention.py "${TABLE[@]}" --out "$OUT/decode_attention_gluon.json" \
  | grep -E "kernel:|sdpa"; el "kernel table"
if [ -n "$BASELINE" ]; then
  (cd "$BASELINE" && timeout 150 python benchmarks/kernels/bench_decode_attention.py "${TABLE[@]}" \
    --out "$OUT/decode_attention_gluon_baseline.json" | grep -E "kernel:|sdpa"); el "baseline kernel table"
fi
timeout 150 python benchmarks/quality/domain_model_tables.py --device cuda \
  --formats bf16 fp8_e4m3 int4 nuq2 kivi2 vq tiered:kv_codebook=page --ppl-mode decode-tail --tail-windows 4 \
  --tail-tokens 256 --no-retrieval --out "$OUT/domain_moe_decode_tail.json" | grep -v Warn; el "quality"
