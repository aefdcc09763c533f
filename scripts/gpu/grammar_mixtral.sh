#!/bin/bash
# One GPU call (about 3 minutes on an H200): the grammar's cost a step where the device, not the host, sets
# the step's time. domain-moe's batch-64 step (2.53 ms on the H200, +52% with a regex on every request) is the
# host's work, and the grammar's host parts add to it in full; on a model whose forward outlasts the host's
# work the fill runs while the forward does (model_runner.follow_grammars after the forward is queued) and
# only the masking's kernels remain on the device's path.
# 1. bench_engine on the Mixtral-8x7B shape (random bf16 weights; all 32 layers where the GPU holds them,
#    else the first 16), batch 64 x 4k, async scheduling, each point free and then with every request
#    constrained by a regex ('[t0-9]{20000}': every token but the stop token allowed, never complete).
# (domain-moe's batch-64 step with its host parts is paths_mla_glm.sh's last step.) Carry `wheels`.
# Prediction (H200): Mixtral batch 64: 40.7 ms free (performance.md, "Through the engine"), the regex within
# +1% (the bitmask's copy, unpack and masking: ~5 kernels on 64 x 32,000 logits, ~0.05-0.1 ms; the ~1.3 ms of
# host work hidden under the forward).
# Run from the repository root:  bash scripts/gpu/grammar_mixtral.sh
source "$(dirname "$0")/preamble.sh" grammar_mixtral name,memory.total
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=""; [ "$MEM" -lt 120000 ] && LAYERS="--num-layers 16"
if [ -d wheels ]; then source scripts/gpu/wheels_env.sh; fi
timeout 240 python benchmarks/e2e/bench_engine.py --formats bf16 --points 64:4096 --steps 48 --modes async \
  $LAYERS --grammar '[t0-9]{20000}' --out "$OUT/engine_grammar_mixtral.json" 2>&1 | tail -6; el "Mixtral-shape engine step"
