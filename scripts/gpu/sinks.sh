#!/bin/bash
# One GPU call (about 2 minutes on an H100): do sinks matter for nuq2's depth-0 passkeys on the GPU, as
# the CPU measured them (docs/decisions.md, "Sinks: a measurement option, not built into the kernels")?
# 1) the sinks tests (CPU-side; kv_sink_tokens has no kernel, so there is no kernel test to run);
# 2) domain-moe passkeys, 40 keys a cell, needle at depth 0 at 1k/2k/4k and at token 64 of 4k (depth
#    0.01584; the second page's first token): bf16, nuq2 as it ships (its Gluon kernel on sm_90), nuq2
#    with its first 4 and first 64 tokens in 16-bit (the reference path: with sinks decode steps leave
#    the kernels and CUDA graphs).
# Every step writes under $OUT before the next starts. Run from the repository root:
#   bash scripts/gpu/sinks.sh
# Prediction (the CPU: nuq2 38 of 40 at 4k depth 0, 40 elsewhere; 64 sinks 40 everywhere): bf16 40 in
# every cell; nuq2 39-40 at depth 0 at 4k (the H100 at 3.5 sigma found every 4k needle with 8 keys a
# depth) and 40 elsewhere; 4 sinks as nuq2; 64 sinks 40 at depth 0, as nuq2 at token 64.
source "$(dirname "$0")/preamble.sh" sinks
timeout 120 python -m pytest -q -rf -p no:cacheprovider tests/test_kv_sinks.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
F="bf16 nuq2 nuq2:kv_sink_tokens=4 nuq2:kv_sink_tokens=64"
timeout 150 python benchmarks/quality/domain_passkeys.py --device cuda --trials 40 --depths 0 --formats $F \
  --wrong-answers --out "$OUT/domain_moe_nuq2_sinks_depth0.json" > "$OUT/depth0.log" 2>&1
grep -v Warn "$OUT/depth0.log" | tail -12
timeout 90 python benchmarks/quality/domain_passkeys.py --device cuda --trials 40 --depths 0.01584 --lengths 4096 \
  --formats $F --wrong-answers --out "$OUT/domain_moe_nuq2_sinks_token64.json" > "$OUT/token64.log" 2>&1
grep -v Warn "$OUT/token64.log" | tail -4
