#!/bin/bash
# One GPU call for quantized weights (--quantization fp8 | int4): the quantized kernels' GPU tests
# (MoE GEMV / grouped GEMM and the projection GEMV / GEMM at Mixtral-8x7B shapes, CUDA-graph capture),
# the MoE and projection GEMVs beside bf16 against the copy floor (bench_moe_quant), the decode step of a
# Mixtral-8x7B-shaped model with bf16 / fp8 / int4 weights at 4k context (bench_decode, random weights,
# floors measured in the same run; 32 layers where 16-bit weights fit the GPU, 16 on an 80 GB card), and
# domain-moe's held-out drama perplexity through the engine on CUDA (prefill: the dequantizing GEMMs) with
# each weight format. Each step writes its file to $OUT before the next starts. Run from the repository
# root (under 4 minutes):
#     PYTHONPATH=. bash scripts/gpu/wquant.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" wquant name,memory.total
MEM_MB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=32; [ "$MEM_MB" -lt 100000 ] && LAYERS=16
timeout 60 python -m pytest -q -m gpu -n 4 -rf -p no:cacheprovider tests/test_quant_kernels.py \
  > "$OUT/gpu_tests_wquant.log" 2>&1
tail -3 "$OUT/gpu_tests_wquant.log"; el "quantized kernel tests"
# 100 s: at 35 s the int4 T=8 / 64 rows were cut; the tile rows time the GEMV's tiles at T=1
timeout 100 python benchmarks/kernels/bench_moe_quant.py --tokens 1 2 4 8 64 --gemv-tiles 8x1024 16x1024 8x2048 \
  --out "$OUT/moe_quant.json" > "$OUT/moe_quant.log" 2>&1
grep -E "moe|qkv|bandwidth|Error" "$OUT/moe_quant.log"
el "MoE / projection GEMVs"
timeout 100 python benchmarks/e2e/bench_decode.py --random-weights --weights bf16 fp8 int4 --formats bf16 \
  --points 1:4096 16:4096 64:4096 --iters 10 --num-layers "$LAYERS" --no-transformers \
  --out "$OUT/decode_wquant.json" | grep -E "TPOT|skipped|GiB|bandwidth"
el "decode rows ($LAYERS layers)"
for q in none fp8 int4; do
  flag=""; [ "$q" != none ] && flag="--quantization $q"
  timeout 25 python -m moekv.cli eval ppl --device cuda $flag --mode prefill --text models/domain-moe/heldout/drama.txt \
    --max-tokens 8192 --json > "$OUT/ppl_drama_$q.json" 2> "$OUT/ppl_drama_$q.log"
  echo "weights $q: $(grep -oE '"ppl": [0-9.]+' "$OUT/ppl_drama_$q.json" | head -1)"
done
el "domain-moe perplexity"
