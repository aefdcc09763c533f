#!/usr/bin/env bash
# Keys stored before RoPE (kv_keys_before_rope) on one GPU: the option's tests on CUDA (the Triton decode
# kernel against float64 attention over gather, fp32 and bf16 queries, the benchmark's shape), then
# decode-attention timings of nuq2 and vq with and without the option, and their Gluon kernels (which
# refuse the option: the rows to compare against), SDPA in the same run.
# Run from the repository root:  PYTHONPATH=. OUT=/some/dir bash scripts/gpu/prerope.sh   (< 4 min)
set -uo pipefail
: "${OUT:?set OUT to a folder for the results}"
mkdir -p "$OUT"
export PYTHONPATH="${PYTHONPATH:-.}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 8")

timeout 100 python -m pytest -q $XDIST -rf -p no:cacheprovider tests/test_kv_keys_before_rope.py \
    -k "not engine_reads and not engine_decode_steps and not calibrate and not sm90" 2>&1 | tee "$OUT/tests.txt" | tail -5

B="python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_prerope vq vq_prerope --kernel triton gluon --configs 0"
# two runs (each writes its file at its end; the second reuses the first's compiled kernels)
timeout 75 $B --shapes 1x4096 16x32768 --out "$OUT/decode_attention_prerope_a.json" 2>&1 | tee "$OUT/bench_a.txt" | tail -20
timeout 55 $B --shapes 64x32768 1x131072 --out "$OUT/decode_attention_prerope_b.json" 2>&1 | tee "$OUT/bench_b.txt" | tail -20
