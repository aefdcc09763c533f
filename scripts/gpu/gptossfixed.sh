#!/bin/bash
# One GPU call (about 3 minutes on an H100): gpt-oss's batch-1 decode step without its small PyTorch kernels
# (YaRN RoPE in the fused RoPE + KV write, the router's logit bias in the router GEMV; issue 48).
#   1. the GPU tests that cover it: the gpt-oss tests on CUDA (bf16 graphs against eager in every format, fp32
#      logits against transformers, MXFP4 experts), the fused RoPE + KV write with YaRN on CUDA, the RoPE and
#      router kernels, and the CPU count of a decode layer's kernels (test_decode_kernel_count);
#   2. the step's profile (profile_decode_step.py, gpt-oss-20b's shape, bf16 KV, batch 1 at 4k);
#   3. bench_decode at 1:4096 and 32:32768 on this tree, then on the baseline tree BASELINE_OVERLAY (a folder
#      holding main's `moekv`, e.g. `mkdir B && git archive main moekv | tar x -C B`; carry it), same GPU;
#      the JSONs' moekv_tree names the tree each ran.
# Prediction (H100; the CPU count is 12 kernels a layer against 34, the profile's 35 with cuBLAS's split-K
# reduce): the graph step's kernels 845 -> 293 a step, kernel time 4.55 -> ~3.5 ms (the removed kernels
# took 1.08 ms in h100/profile_gpt_oss_20b_b1.txt; the fused write and the router GEMV add ~0.1 ms);
# bench_decode batch 1 at 4k: ~1.0 ms faster a step than the baseline (about 4.6 -> 3.6 ms, ~2.0x -> ~1.55x
# its floor); 32:32768 skipped on an H100 (51.5 GiB of bf16 KV beside 42 GB of weights), on an H200
# ~1 ms faster a step. Greedy tokens and fp32 logits as before (tests pass).
# Run from the repository root:  BASELINE_OVERLAY=B bash scripts/gpu/gptossfixed.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" gptossfixed
timeout 110 python -m pytest -q -n 8 -rf -p no:cacheprovider --tb=long tests/test_gpt_oss.py \
  tests/test_rope_kv_write.py tests/test_norm_rotary_kernels.py tests/test_router_gemv.py \
  tests/test_decode_kernel_count.py > "$OUT/gpu_tests_gptossfixed.log" 2>&1
tail -4 "$OUT/gpu_tests_gptossfixed.log"; el "GPU tests"
timeout 60 python benchmarks/tools/count_decode_ops.py --shape gpt-oss-20b > "$OUT/count_decode_ops.txt" 2>&1
tail -2 "$OUT/count_decode_ops.txt"; el "kernels a layer (CPU count)"
timeout 75 python benchmarks/tools/profile_decode_step.py --shape gpt-oss-20b --format bf16 --batch 1 --context 4096 \
  > "$OUT/profile_gpt_oss_20b_b1.txt" 2>&1
grep -E "^== " "$OUT/profile_gpt_oss_20b_b1.txt"; el "profile"
ARGS="--random-weights --shape gpt-oss-20b --formats bf16 --points 1:4096 32:32768 --no-transformers"
timeout 75 python benchmarks/e2e/bench_decode.py $ARGS --out "$OUT/decode_gpt_oss_20b_fixed.json" 2>&1 \
  | grep -E "TPOT|skipped|GiB"
el "bench_decode (this tree)"
if [ -n "$BASELINE_OVERLAY" ] && [ -d "$BASELINE_OVERLAY/moekv" ]; then
  PYTHONPATH="$BASELINE_OVERLAY:." timeout 75 python benchmarks/e2e/bench_decode.py $ARGS \
    --out "$OUT/decode_gpt_oss_20b_main.json" 2>&1 | grep -E "TPOT|skipped|GiB"
  el "bench_decode (baseline)"
else
  echo "BASELINE_OVERLAY unset or without moekv/: no baseline run"
fi
grep -h '"moekv_tree"' "$OUT"/decode_gpt_oss_20b_*.json  # the two runs must name different trees
