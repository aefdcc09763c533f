#!/bin/bash
# One GPU call for the residual window of nuq2 and vq (kvcache/formats/residual.py): the gpu-marked tests
# of the nuq2, vq, kivi2 and tiered decode kernels (Gluon and Triton) and of the engine's Gluon path (the
# window's own cases first), then the Gluon decode-attention table of nuq2 and vq without a window (rows
# nuq2_gluon, vq_gluon) and with their default one (nuq2_r128_gluon, vq_r256_gluon), SDPA beside, all in
# the same run. Each step writes its file to $OUT before the next starts, so a call cut short keeps what
# finished. Run from the repository root (under 4 minutes):
#     bash scripts/gpu/kvwin.sh 2>&1 | tee $OUT/log
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:=/tmp/kvwin}"; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name --format=csv,noheader
PARALLEL=$(python -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist where the machine has it
TESTS=(tests/test_gluon_nuq2_decode.py tests/test_gluon_vq_decode.py tests/test_gluon_kivi2_decode.py
       tests/test_gluon_tiered_decode.py tests/test_gluon_engine.py tests/test_decode_attention.py
       tests/test_decode_vq.py tests/test_decode_tiered.py)
WINDOW="residual or nuq2_r48 or takes_the_gluon"  # the ring's kernel tests and the engine's Gluon path with it
timeout 75 python -m pytest -q -m gpu $PARALLEL -p no:cacheprovider -k "$WINDOW" \
  "${TESTS[@]}" > "$OUT/gpu_tests_window.log" 2>&1
tail -3 "$OUT/gpu_tests_window.log"; el "gpu tests of the window"
timeout 95 python -m pytest -q -m gpu $PARALLEL -p no:cacheprovider -k "not ($WINDOW)" \
  "${TESTS[@]}" > "$OUT/gpu_tests_rest.log" 2>&1
tail -3 "$OUT/gpu_tests_rest.log"; el "the other gpu tests"
timeout 60 python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_r128 vq vq_r256 --kernel gluon \
  --shapes 1x4096 16x32768 64x32768 1x131072 --configs 0 --out "$OUT/decode_attention_kvwin.json" \
  | grep -E "kernel:|sdpa|gluon"; el "kernel table"
