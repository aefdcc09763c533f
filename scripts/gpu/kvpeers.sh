#!/bin/bash
# One GPU call (run from the repository root, about 3 minutes on an H100/H200, no network): every KV
# format of the tradeoff plot on domain-moe under one engine, decode-tail perplexity (2 windows of
# 4096 a held-out domain, the last 256 tokens each fed by decode steps) and passkey retrieval at
# 1k/2k/4k, into $OUT/domain_moe_kv_tables_decode_tail.json; then the plot with the transformers
# peers measured on the CPU. Results are written after each format, so a cut call keeps what finished.
# (nuq2 reads per-page codebooks here: the shipped kv_calibration holds vq's codebooks only.)
#   bash scripts/gpu/kvpeers.sh 2>&1 | tee $OUT/log
# Copy $OUT/domain_moe_kv_tables_decode_tail.json to benchmarks/results/<device>/ and re-draw
# (docs/quality.md, "Bits against quality").
set -eo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:?set OUT to the folder for the results}"
python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
    --formats bf16 fp8_e4m3 int4 kivi2 nuq2 vq tiered:kv_codebook=page \
    --out "$OUT/domain_moe_kv_tables_decode_tail.json"
python benchmarks/quality/plot_kv_tradeoff.py --tables "$OUT/domain_moe_kv_tables_decode_tail.json" \
    --peers benchmarks/results/cpu/hf_quantized_cache_domain-moe.json benchmarks/results/cpu/hf_quantized_cache_retrieval_domain-moe.json \
            benchmarks/results/cpu/hf_quantized_cache_group64_domain-moe.json \
    --out "$OUT/kv_tradeoff_domain-moe.png" \
    || echo "plot skipped (matplotlib missing?); the JSON is complete"
