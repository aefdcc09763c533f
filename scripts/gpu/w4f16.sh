#!/bin/bash
# One GPU call for int4's GEMV dots in packed halves (quant_tiles.int4_f16_dots and the run GEMV's run_f16_dots,
# QuantGemvConfig / QuantGemvShape f16_dots; off by default until this call confirms it): the GPU tests of the
# packed-half path (the MoE pair GEMV at T = 1 2 4 and the run GEMV at T = 8 with P = 2 and 4, runs longer than P,
# against the dequantized reference, Mixtral-8x7B's and gpt-oss-20b's shapes, symmetric and zero points, activations
# with outliers to 5,000; the projection GEMV against the numpy emulation of its arithmetic and the float64 bound)
# and the quantized kernels' existing GPU tests (the fp32 path, whose tile loads moved); the MoE GEMVs at
# T = 1 2 4 8 16 with fp32 and packed-half dots in the same run (the pair GEMV to T = 8, the run GEMV at P = 2 and 4
# at every T; each T's default path beside: at T = 16 the swap-AB grouped GEMM), fp8 beside, and the int4
# projection GEMV both ways (bench_moe_quant --f16-dots --dots-paths gemv runs); the 16-layer Mixtral-8x7B-shaped
# decode step at batch 1, 4k, int4 weights, dots off then on (bench_decode --f16-dots both). Each step writes
# under $OUT before the next starts. Under 4 minutes on an H100 (~1.5 min of tests, ~1.25 min of kernels, ~1 min
# of decode):
#     PYTHONPATH=. bash scripts/gpu/w4f16.sh 2>&1 | tee $OUT/log
#
# Prediction (H100, from the sm_90 SASS of benchmarks/tools/sass_moe_quant_gemv.py --f16-dots; docs/decisions.md,
# "The int4 GEMV's dot in packed halves"): warp instructions a weight byte 0.311 -> 0.183 (gate/up, 16 x 1024) and
# 0.328 -> 0.211 (down); the T=1 call ~59 M -> ~36 M warp instructions. At the old path's measured issue rate
# (655 G a second) that is 0.055 ms, below the 0.062 ms floor, so the MoE GEMV at T=1 reads at 0.78-0.90 of its floor
# (0.069-0.079 ms against 0.0906 ms, 0.68); T=2 / 4 from 0.57-0.60 to 0.72-0.85; the pair GEMV at T=8 from 0.42 to
# 0.55-0.68; fp8 unchanged (~0.93 at T=1). The int4 projection GEMV at T=1 from 0.43 to 0.50-0.60 (a ~10 us kernel,
# partly fixed cost). The batch-1 step (16 layers) from ~2.27 ms (1.85x its floor) to 1.85-2.05 ms (1.5-1.65x).
# Every packed-half row's max_err within 1e-3 of the fp32 row's. On an H200 (more bandwidth, the same SMs) the
# GEMV stays issue-bound: ~0.70-0.80 of its floor at T=1.
# The run GEMV (docs/decisions.md, "The int4 GEMV's dot in packed halves"; sass_moe_quant_gemv.py --f16-dots): a K
# step of the 16 x 1024 tiles, P = 2, gate/up 1,700 -> 1,177 instructions (0.391 -> 0.270 warp instructions a
# weight byte), down 942 -> 663; P = 4 2,452 -> 1,932 and 1,412 -> 1,130. Whole calls (uniform top-2 routing):
# T=8 at P = 2 377 M -> 263 M warp instructions (the pair GEMV's packed halves 288 M), T=16 at P = 4 607 M -> 481 M
# (at P = 2 475 M). At 655-803 G a second: the run GEMV at T=8 (P = 2) 0.33-0.40 ms, 0.62-0.76 of its 0.248 ms
# floor (fp32 dots ~0.47-0.58; the pair GEMV's packed halves 0.36-0.44, so runs stay the faster path at T=8 by
# ~10%); at T=16 (P = 4, and P = 2 alike) 0.60-0.73 ms, 0.34-0.41 of the floor, level with the swap-AB GEMM's
# 0.67 ms (fp32 dots 0.76-0.93); at T = 1 2 4 the run GEMV stays behind the pair GEMV, as with fp32 dots.
source "$(dirname "$0")/preamble.sh" w4f16 name,memory.total
# serially: four pytest workers ran an H100 out of memory
timeout 150 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_f16_dots.py tests/test_quant_kernels.py \
  > "$OUT/gpu_tests_w4f16.log" 2>&1
tail -8 "$OUT/gpu_tests_w4f16.log"; el "GPU tests (packed-half dots, quantized kernels)"
timeout 120 python benchmarks/kernels/bench_moe_quant.py --weights fp8 int4 --tokens 1 2 4 8 16 --f16-dots \
  --dots-paths gemv runs --run-pairs 2 4 --out "$OUT/moe_quant_f16.json" > "$OUT/moe_quant_f16.log" 2>&1
grep -E "moe|qkv|bandwidth|Error" "$OUT/moe_quant_f16.log"
el "MoE pair / run GEMVs, projection GEMV, fp32 and packed-half dots"
timeout 80 python benchmarks/e2e/bench_decode.py --random-weights --weights int4 --formats bf16 --points 1:4096 \
  --num-layers 16 --iters 10 --no-transformers --f16-dots both \
  --out "$OUT/decode_w4f16.json" > "$OUT/decode_w4f16.log" 2>&1
grep -E "TPOT|skipped|GiB|bandwidth|Error" "$OUT/decode_w4f16.log"
el "decode step (16 layers, int4, dots off / on)"
