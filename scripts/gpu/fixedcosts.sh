#!/bin/bash
# One GPU call (about 4 minutes on an H200): where the batch-1 decode step's time goes on the shapes whose
# step is furthest from its floor beside its weights (issue 48: gpt-oss-20b 2.00x on an H200, GLM-4.5-Air's
# 10 layers 1.23x on an H100; target 1.2x on an H200): the kernels of one step under torch.profiler, eager and
# replayed from its CUDA graph, by name, launches and GPU time a step (benchmarks/tools/profile_decode_step.py).
# Prediction: gpt-oss-20b at (1, 4k), bf16 KV: the MoE's GEMV ~1.5 ms of the 3.5 (its 24 layers' experts), the
#   attention projections and the attention ~0.6, the rest (~1.2 ms) in ~15 small kernels a layer (norms,
#   router, sinks' reduce, RoPE and KV write, residual adds), 5-20 us each; GLM-4.5-Air's the same shape of
#   split at fewer, larger layers. The table names which small kernels to fuse first.
# Each step writes its file to $OUT before the next starts. Run from the repository root:
#   bash scripts/gpu/fixedcosts.sh
source "$(dirname "$0")/preamble.sh" fixedcosts
timeout 150 python benchmarks/tools/profile_decode_step.py --shape gpt-oss-20b --format bf16 --batch 1 --context 4096 \
  > "$OUT/profile_gpt_oss_20b_b1.txt" 2>&1; tail -30 "$OUT/profile_gpt_oss_20b_b1.txt"
timeout 120 python benchmarks/tools/profile_decode_step.py --shape glm-4.5-air-10l --format bf16 --batch 1 --context 4096 \
  > "$OUT/profile_glm45air10l_b1.txt" 2>&1; tail -30 "$OUT/profile_glm45air10l_b1.txt"
# DeepSeek-V2-Lite's whole model (issue 49: 2.71x its floor at batch 1 on an H100), bf16 latent, one (1, 4k) step.
# Prediction: its 27 layers' MLA (the absorbed decode ~15 us a layer, the q / kv_a / kv_b projections and
# norms ~6 kernels a layer) and MoE (64 experts top-6, two shared) spend ~2 ms of the 4.6 in small kernels.
timeout 120 python benchmarks/e2e/bench_mla_decode.py --shapes deepseek-v2-lite --kv bf16 --points 1:4096 \
  --iters 10 --profile > "$OUT/profile_v2lite_b1.txt" 2>&1; tail -32 "$OUT/profile_v2lite_b1.txt"
