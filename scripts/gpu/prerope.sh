#!/usr/bin/env bash
# Keys stored before RoPE (kv_keys_before_rope) on one GPU: nuq2's Gluon kernel with the rotation (rope_theta)
# against float64 attention over the rotated pages (slots, staged tail, ring, windows, bf16 / fp16 queries) and
# through the engine's attend, the Triton kernel's tests, then decode-attention timings of nuq2 and nuq2_prerope
# with the Gluon kernel (rows nuq2_gluon, nuq2_prerope_gluon) at 1x4096, 16x32768, 64x32768 and 1x131072.
# Run from the repository root:  PYTHONPATH=. OUT=/some/dir bash scripts/gpu/prerope.sh   (< 4 min)
set -uo pipefail
: "${OUT:?set OUT to a folder for the results}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 8")

# the Gluon kernel with the option first (its own file), then the Triton kernel's tests
timeout 90 python -m pytest -q $XDIST -p no:cacheprovider tests/test_kv_keys_before_rope.py -k "gpu and gluon" \
    2>&1 | tee "$OUT/tests_gluon.txt" | tail -5
timeout 60 python -m pytest -q $XDIST -p no:cacheprovider tests/test_kv_keys_before_rope.py \
    -k "not gluon and not engine_reads and not engine_decode_steps and not calibrate and not sm90" \
    2>&1 | tee "$OUT/tests_triton.txt" | tail -5

B="python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_prerope --kernel gluon --configs 0"
# two runs (each writes its file at its end; the second reuses the first's compiled kernels)
timeout 40 $B --shapes 1x4096 16x32768 --out "$OUT/decode_attention_prerope_gluon_a.json" 2>&1 | tee "$OUT/bench_a.txt" | tail -12
timeout 40 $B --shapes 64x32768 1x131072 --out "$OUT/decode_attention_prerope_gluon_b.json" 2>&1 | tee "$OUT/bench_b.txt" | tail -12
