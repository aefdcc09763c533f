#!/bin/bash
# One GPU call (about 3 minutes on an H100): do the GPU's Gluon path and bf16 model miss depth-0 passkeys
# when the benchmark's schedule splits the needle across prefill chunks, as the CPU did
# (docs/decisions.md, "Depth-0 passkeys on the CPU: the scheduler split the needle")?
# 1) the prefill tests (-rf);
# 2) domain-moe passkeys as benchmarks/quality/domain_passkeys.py calls the engine (one length a call, so
#    at 4k the first 13 of 40 depth-0 prompts start with a chunk of 8-29 tokens, inside the needle:
#    benchmarks/results/cpu/passkey_chunk_cuts.json), 40 keys at depth 0 a length: bf16, nuq2, vq, with
#    the staged rows read in 16 bits (this branch);
# 3) the same prompts with the staged rows read through the page the step quantized (the code before
#    this branch: dense.with_step_kv's `staged` dropped), nuq2 and vq.
# Prediction (the CPU, float32, the same prompts at 4k: before vq 36 and nuq2 38 of 40, every miss a cut
# needle (vq trials 2-5, nuq2 3 and 5); after 40 each; the model in bfloat16 on the CPU missed as float32
# did): 2) bf16 40 / 40 / 40, nuq2 and vq 40 / 40 / 40 (39 at worst in a cell); 3) at 4k nuq2 37-39 and vq
# 34-38, every miss among trials 1-13 (the cut needles), 38-40 at 1k and 2k.
# Every step writes under $OUT before the next starts. Run from the repository root:
#   bash scripts/gpu/depth0.sh
source "$(dirname "$0")/preamble.sh" depth0
timeout 120 python -m pytest -q -rf -p no:cacheprovider tests/test_kv_prefill_exact.py > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"; el "tests"
timeout 150 python benchmarks/quality/domain_passkeys.py --device cuda --trials 40 --depths 0 \
  --formats bf16 nuq2 vq --wrong-answers --out "$OUT/domain_moe_depth0_staged.json" > "$OUT/staged.log" 2>&1
grep -v Warn "$OUT/staged.log" | tail -9; el "passkeys, staged rows in 16 bits"
timeout 150 python - "$OUT/domain_moe_depth0_unstaged.json" > "$OUT/unstaged.log" 2>&1 <<'PY'
import runpy, sys
import moekv.kvcache.formats.dense as dense
import moekv.kvcache.formats.paged as paged
import moekv.kvcache.formats.tiered as tiered
original = dense.with_step_kv
def unstaged(gather, ctx, step_kv, staged=None):  # the code before: no staged rows
    return original(gather, ctx, step_kv)
paged.with_step_kv = tiered.with_step_kv = unstaged
sys.argv = ["domain_passkeys.py", "--device", "cuda", "--trials", "40", "--depths", "0", "--formats", "nuq2", "vq",
            "--wrong-answers", "--out", sys.argv[1]]
sys.path.insert(0, "benchmarks/quality")
runpy.run_path("benchmarks/quality/domain_passkeys.py", run_name="__main__")
PY
grep -v Warn "$OUT/unstaged.log" | tail -6; el "passkeys, staged rows through the fresh page"
