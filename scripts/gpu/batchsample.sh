#!/usr/bin/env bash
# Batched sampling on a GPU (docs/decisions.md, "Batched sampling: an exponential race on counter-based noise"):
# 1. the sampler's tests on the device's torch, the CUDA-against-CPU token test included (it prints how many of
#    8,000 draws differ; at most one may);
# 2. the structured-output GPU test (CUDA graphs, sync and async scheduling, grammar rows beside free ones);
# 3. sample_async's host time (until it returns) and total time (until the tokens are on the host) at batch 1
#    and 64 over 4,096 / 32,000 / 151,936 tokens, per sampling setting;
# 4. firsthour.sh's mask line: the grammar mask's fill and apply at batch 64 on domain-moe's vocabulary, against
#    domain-moe's batch-64 TPOT at temperature 1 (seeded rows) without and with a regex on every request
#    (issue 50's target: the mask under 5% of the free TPOT). With the per-row sampler, on an H100: free 10.26 ms,
#    regex 11.91 ms (+16.1%), mask 1.10 ms = 10.7% (benchmarks/results/h100/grammar_engine_cuda.json).
#    With the batched sampler, on an H200: free 2.53 ms, regex 3.86 ms (+52%), mask 0.82 ms = 32%
#    (benchmarks/results/h200/grammar_engine_cuda.json). The engine step also reports the host's ms a step in
#    each grammar call: if they add up to the ~1.3 ms difference the matchers' host work is the lever (fill off
#    the critical path, fewer calls); if follow_grammars' wait for the previous step's tokens holds most of it,
#    the step's order is. Prediction: fill 0.2-0.5 ms (xgrammar's pool), masking 0.1-0.2, accept_at 0.2-0.4,
#    the wait under 0.2; one fill thread no slower than the pool at 64 regex rows.
# Needs the wheels of scripts/gpu/firsthour_wheels.sh: carry `wheels`. Run from the repository root:
#   bash scripts/gpu/batchsample.sh      (results under $OUT; about two to three minutes on an H100)
source "$(dirname "$0")/preamble.sh" batchsample
source scripts/gpu/wheels_env.sh
timeout 120 python3 -m pytest -q -rf -s -p no:cacheprovider tests/test_sampling.py \
  > "$OUT/sampling_tests.log" 2>&1; grep -E "differ in|passed|failed" "$OUT/sampling_tests.log" | tail -3
timeout 120 python3 -m pytest -q -rf -p no:cacheprovider tests/test_structured_outputs_gpu.py -m gpu \
  > "$OUT/structured_gpu_test.log" 2>&1; tail -3 "$OUT/structured_gpu_test.log"
timeout 120 python3 benchmarks/e2e/bench_sampler.py --device cuda --batch 1 64 --vocab 4096 32000 151936 --steps 50 \
  --out "$OUT/sampler_cuda.json" > "$OUT/sampler_cuda.log" 2>&1; tail -2 "$OUT/sampler_cuda.log"
timeout 60 python3 benchmarks/e2e/bench_grammar_mask.py --mask --batch 64 --steps 100 --device cuda \
  --out "$OUT/mask_cuda.json" > "$OUT/mask_cuda.log" 2>&1; tail -1 "$OUT/mask_cuda.log"
timeout 150 python3 benchmarks/e2e/bench_grammar_mask.py --engine --batch 64 --steps 200 --device cuda \
  --out "$OUT/engine_cuda.json" 2>&1 | tail -20 > "$OUT/engine_cuda.log"; tail -1 "$OUT/engine_cuda.log"
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
out = sys.argv[1]
for r in json.load(open(f"{out}/sampler_cuda.json")):
    if r["batch"] == 64:
        print(f"sample_async B=64 V={r['vocab']:>6} {r['setting']:>18}: host {r['queue_ms']:.3f} ms, "
              f"to the host {r['total_ms']:.3f} ms")
mask = {(r["engine"], r["vocab"], r["batch"]): r for r in json.load(open(f"{out}/mask_cuda.json"))}
eng = json.load(open(f"{out}/engine_cuda.json"))[0]
free, cost = eng["free_tpot_ms"], mask[("xgrammar", 4096, 64)]["total_ms"]
print(f"domain-moe, batch 64: mask {cost:.3f} ms = {100 * cost / free:.2f}% of the free TPOT {free:.3f} ms "
      f"(target < 5%); TPOT with a grammar on every request {eng['regex_tpot_ms']:.3f} ms "
      f"({100 * eng['overhead']:+.1f}%; an H200's run with the batched sampler: 2.53 ms free, +52%)")
print("host ms a step in the grammar's calls:", {k: round(v, 3) for k, v in eng["regex_host_ms"].items()},
      f"; xgrammar's fill on one thread: TPOT {eng['regex_one_fill_thread_tpot_ms']:.3f} ms "
      f"({100 * eng['overhead_one_fill_thread']:+.1f}%)")
PY
