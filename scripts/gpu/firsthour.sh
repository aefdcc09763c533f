#!/usr/bin/env bash
# Structured outputs on a GPU: the per-step cost of the grammar mask (bitmask filled on the host, applied
# on the device) at batch 1 and 64, and domain-moe's decode step time (TPOT) at batch 64 with and without
# a grammar on every request (target: the mask's cost at batch 64 under 5% of the unconstrained TPOT),
# after the structured-output GPU test (CUDA graphs, sync and async scheduling); the mask's cost at 32k
# and 152k vocabularies too (synthetic), against the Mixtral-8x7B-shaped batch-64 step of performance.md.
# Needs the wheels of scripts/gpu/firsthour_wheels.sh: carry `wheels`. Run from the repository root:
#   bash scripts/gpu/firsthour.sh      (results under $OUT; about two to three minutes on an H100/H200)
source "$(dirname "$0")/preamble.sh" firsthour
source scripts/gpu/wheels_env.sh
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider tests/test_structured_outputs_gpu.py -m gpu \
  > "$OUT/gpu_test.log" 2>&1; tail -3 "$OUT/gpu_test.log"
timeout 120 python3 benchmarks/e2e/bench_grammar_mask.py --mask --batch 1 64 --steps 100 --device cuda --vocab 32000 151936 \
  --out "$OUT/mask_cuda.json" 2>&1 | tee "$OUT/mask_cuda.log"
timeout 150 python3 benchmarks/e2e/bench_grammar_mask.py --engine --batch 64 --steps 200 --device cuda \
  --out "$OUT/engine_cuda.json" 2>&1 | tail -20 | tee "$OUT/engine_cuda.log"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
mask = {(r["engine"], r["vocab"], r["batch"]): r for r in json.load(open(f"{out}/mask_cuda.json"))}
eng = json.load(open(f"{out}/engine_cuda.json"))[0]
free, cost = eng["free_tpot_ms"], mask[("xgrammar", 4096, 64)]["total_ms"]
print(f"domain-moe, batch 64: mask {cost:.3f} ms = {100 * cost / free:.2f}% of the free TPOT {free:.3f} ms "
      f"(target < 5%); TPOT with a grammar on every request {eng['regex_tpot_ms']:.3f} ms ({100 * eng['overhead']:+.1f}%)")
for vocab in (32000, 151936):  # against the Mixtral-8x7B-shaped step of docs/performance.md (B=64, 4k, async)
    r = mask[("xgrammar", vocab, 64)]
    print(f"vocab {vocab}, batch 64: fill {r['fill_ms']:.3f} + apply {r['apply_ms']:.3f} = {r['total_ms']:.3f} ms "
          f"= {100 * r['total_ms'] / 40.7:.2f}% of a 40.7 ms step")
PY
