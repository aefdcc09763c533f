#!/bin/bash
# One GPU call for gpt-oss (GptOssForCausalLM): the attention sinks in every format's decode kernels
# (Gluon at head_dim 128 / pages of 64, Triton at gpt-oss's head_dim 64), the fused MoE's bias and
# clamped-SwiGLU epilogues compiled, the MXFP4 experts' kernels (gpt-oss-20b's expert shape against the
# bf16 kernel on the dequantized weights, CUDA-graph capture), the gpt-oss tests on CUDA (bf16 decode
# steps from CUDA graphs against eager, fp32 logits against transformers, MXFP4 experts kept quantized),
# then where the bf16 graphs-against-eager case parts (gptoss_graph_diag.py), the MoE kernel row at
# gpt-oss-20b's shape (bf16 / mxfp4 / fp8 / int4 against the weight-byte floor), the tiered reduce's GPU
# tests (its merge takes the sinks) and a gpt-oss-20b-shaped decode row (random bf16 weights). Each step
# writes its file to $OUT before the next starts. Run from the repository root (under 4 minutes):
#     PYTHONPATH=. bash scripts/gpu/gptoss.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" gptoss
timeout 85 python -m pytest -q -n 8 -rf -p no:cacheprovider --tb=long tests/test_attention_sinks.py \
  tests/test_fused_moe_gpt_oss.py tests/test_mxfp4_kernels.py tests/test_gpt_oss.py > "$OUT/gpu_tests_gptoss.log" 2>&1
tail -4 "$OUT/gpu_tests_gptoss.log"; el "gpt-oss and MXFP4 tests"
timeout 60 python scripts/gpu/gptoss_graph_diag.py --out "$OUT/gptoss_graph_diag.json" > "$OUT/gptoss_graph_diag.log" 2>&1
grep -E '"parts_at": [0-9]|max_diff' "$OUT/gptoss_graph_diag.log" | cut -c1-200 | head -12; el "bf16 graph diagnosis"
timeout 60 python benchmarks/kernels/bench_moe_quant.py --shape gpt-oss-20b --weights bf16 mxfp4 fp8 int4 \
  --tokens 1 2 4 8 --out "$OUT/moe_quant_gpt_oss_20b.json" | grep -E "moe|qkv|bandwidth"
el "MoE kernel row (gpt-oss-20b)"
timeout 90 python -m pytest -q -m gpu -n 8 -rf -p no:cacheprovider tests/test_decode_tiered.py \
  tests/test_gluon_tiered_decode.py > "$OUT/gpu_tests_tiered.log" 2>&1
tail -3 "$OUT/gpu_tests_tiered.log"; el "tiered reduce tests"
timeout 30 python benchmarks/e2e/bench_decode.py --random-weights --shape gpt-oss-20b --formats bf16 fp8_e4m3 nuq2 \
  --points 1:4096 --iters 10 --no-transformers --out "$OUT/decode_gpt_oss_20b.json" | grep -E "TPOT|skipped|GiB"
el "gpt-oss-20b decode row"
