#!/bin/bash
# One GPU call (about 3-4 minutes on an H100): nuq2's fragment tables at the slabs' bits (fragment order
# version 2: int16 slot positions, fp16 deltas, uint8 counts, no FP8 slot values; docs/decisions.md, "nuq2's
# fragment tables at the slabs' bits"). 1) the Gluon nuq2 and tiered GPU tests (kernels against their float64
# split references and dense attention, the engine's attend and captured fill steps); 2) the two kernels'
# times at (1, 4k), (16, 32k), (64, 32k), (1, 128k), and the same benchmark from `main` on the same machine
# when the checkout has it (a git worktree under /tmp), the baseline to compare against; 3) domain-moe's
# decode-tail perplexity and passkeys, bf16 against nuq2 (the CPU measured no change: the slabs are the same).
# Prediction: every test passes; times within 1-2% of main's kernels (fewer bytes, the same work: +13
# instructions in nuq2's 1660-instruction page, tiered's unchanged with shared memory); quality as main's.
# Run from the repository root:  bash scripts/gpu/nuq2bits.sh
source "$(dirname "$0")/preamble.sh" nuq2bits
# (an H200 ran 13 of these in 90 s, the rest compiling: xdist where the machine has it, and 150 s)
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n 8")
timeout 150 python -m pytest -q -rf -p no:cacheprovider -m gpu $PARALLEL tests/test_gluon_nuq2_decode.py \
  tests/test_gluon_tiered_decode.py tests/test_gluon_engine.py -k "nuq2 or tiered" > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"
FORMATS="nuq2 nuq2_sigma35 tiered"; SHAPES="1x4096 16x32768 64x32768 1x131072"
timeout 90 python benchmarks/kernels/bench_decode_attention.py --formats $FORMATS --kernel gluon --configs 0 \
  --shapes $SHAPES --out "$OUT/decode_attention_nuq2bits.json" > "$OUT/bench.log" 2>&1
tail -12 "$OUT/bench.log"
# The baseline: main's kernels on the same machine, from a git worktree, or (a checkout without git history)
# from BASELINE_OVERLAY, a folder holding main's versions of the files this change touches, laid over a copy.
BASE=/tmp/nuq2bits_main; rm -rf "$BASE"
if git rev-parse -q --verify main > /dev/null 2>&1; then
  git worktree add -f --detach "$BASE" main > "$OUT/baseline_worktree.log" 2>&1
elif [ -d "${BASELINE_OVERLAY:-}" ]; then
  mkdir -p "$BASE" && cp -r moekv benchmarks "$BASE"/ && cp -r "$BASELINE_OVERLAY"/. "$BASE"/
fi
if [ -d "$BASE/moekv" ]; then
  (cd "$BASE" && PYTHONPATH=. timeout 90 python benchmarks/kernels/bench_decode_attention.py \
    --formats $FORMATS --kernel gluon --configs 0 --shapes $SHAPES \
    --out "$OUT/decode_attention_main.json" > "$OUT/bench_main.log" 2>&1)
  tail -12 "$OUT/bench_main.log"
  git worktree remove -f "$BASE" > /dev/null 2>&1; rm -rf "$BASE"
else
  echo "no baseline (no main branch, no BASELINE_OVERLAY): compare with benchmarks/results/h200/decode_attention_gluon.json" \
    | tee "$OUT/bench_main.log"
fi
timeout 100 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 nuq2 --out "$OUT/domain_moe_nuq2bits.json" > "$OUT/tables.log" 2>&1
grep -v Warn "$OUT/tables.log" | tail -6
