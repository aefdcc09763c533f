#!/bin/bash
# One GPU call for the residual window of nuq2 and vq (kvcache/formats/residual.py), its tail read by several
# programs where the wave has room (moekv/ops/gluon/launch.py plan_splits): first the gpu-marked tests of that
# split (the kernels' partials against their split references with the tail over 1 to 16 programs, sinks,
# and the engine's decode taking it), then the Gluon decode-attention table of nuq2 and vq without a window
# (rows nuq2_gluon, vq_gluon) and with their default one (nuq2_r128_gluon, vq_r256_gluon; their
# tail_splits_ms: the same launch with the tail in one program and in the default number), SDPA beside, all
# in the same run, then the window's other gpu tests (nuq2, vq, kivi2 and tiered kernels, Gluon and Triton,
# the engine's Gluon path). Each step writes its file to $OUT before the next starts, so a call cut short
# keeps what finished. On an H100 the test steps' compiles outlast 60-70 s (8 of the split's tests had run
# at 70 s), so they get 150 s each. Run from the repository root (under 7 minutes):
#     bash scripts/gpu/kvwin.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" kvwin
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist where the machine has it
TESTS=(tests/test_gluon_nuq2_decode.py tests/test_gluon_vq_decode.py tests/test_gluon_kivi2_decode.py
       tests/test_kv_residual.py tests/test_gluon_tiered_decode.py tests/test_gluon_engine.py
       tests/test_decode_attention.py tests/test_decode_vq.py tests/test_decode_tiered.py)
SPLIT="split_over_programs or several_programs"  # the ring's tail over several programs
WINDOW="residual or tail_ring or nuq2_r48 or takes_the_gluon"  # the ring's other kernel tests, the engine's Gluon path
timeout 150 python -m pytest -q -rf -m gpu $PARALLEL -p no:cacheprovider -k "$SPLIT" \
  "${TESTS[@]}" > "$OUT/gpu_tests_tail_split.log" 2>&1
tail -3 "$OUT/gpu_tests_tail_split.log"; el "gpu tests of the tail's split"
timeout 100 python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_r128 vq vq_r256 --kernel gluon \
  --shapes 1x4096 16x32768 64x32768 1x131072 --configs 0 --out "$OUT/decode_attention_kvwin.json" \
  | grep -E "kernel:|sdpa|gluon|tail programs"; el "kernel table"
timeout 150 python -m pytest -q -rf -m gpu $PARALLEL -p no:cacheprovider -k "($WINDOW) and not ($SPLIT)" \
  "${TESTS[@]}" > "$OUT/gpu_tests_window.log" 2>&1
tail -3 "$OUT/gpu_tests_window.log"; el "the window's other gpu tests"
