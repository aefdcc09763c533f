#!/bin/bash
# One GPU call for the 2-bit KV work: domain-moe's tables as generation reads the cache (decode-tail
# perplexity on every held-out domain, passkeys at 1k/2k/4k) for the formats as they ship (nuq2 and vq
# with their 16-bit windows), nuq2 with keys before RoPE and tiered with the ranking options; then the
# GPU tests of the window, the keys-before-RoPE readers and the sinks' reduce; then the decode-attention
# table with and without each (same run), and tiered's kernel against its reference on the engine's
# cache states. Each step writes to $OUT before the next starts.
#     bash scripts/gpu/issue46.sh 2>&1 | tee $OUT/log
source "$(dirname "$0")/preamble.sh" issue46
R=kv_codebook=page:kv_rank_window=64:kv_rank_after_prompt=1
timeout 250 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 kivi2 nuq2 nuq2:kv_keys_before_rope=True vq tiered:kv_codebook=page "tiered:$R" \
  --out "$OUT/domain_moe_kv_tables_decode_tail.json" 2>&1 | grep -v Warn | tail -40; el "tables"
timeout 150 python -m pytest -q -m gpu -rf -p no:cacheprovider tests/test_kv_residual.py tests/test_kv_keys_before_rope.py \
  tests/test_attention_sinks.py tests/test_gluon_nuq2_decode.py tests/test_gluon_vq_decode.py \
  > "$OUT/gpu_tests.log" 2>&1; tail -4 "$OUT/gpu_tests.log"; el "gpu tests"
timeout 110 python benchmarks/kernels/bench_decode_attention.py --formats nuq2 nuq2_r128 vq vq_r256 nuq2_prerope \
  --kernel gluon triton --shapes 1x4096 16x32768 64x32768 1x131072 --configs 0 \
  --out "$OUT/decode_attention_window_prerope.json" 2>&1 | grep -E "kernel:|sdpa|gluon|triton|skip" | tail -40; el "kernel table"
timeout 60 python scripts/tiered_decode_diff.py > "$OUT/tiered_decode_diff.log" 2>&1; tail -3 "$OUT/tiered_decode_diff.log"
el "tiered diff"
