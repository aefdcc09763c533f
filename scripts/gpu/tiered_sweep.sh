#!/bin/bash
# One GPU call (about 3 minutes): tiered's options at 10% FP8 pages, the share that reads 3.30 bits at
# 4k (issue 46's target: <= 3.3 bits read and <= +1% perplexity on every domain, passkeys as bf16):
# the ranking window, the re-ranking interval and the low tier's outlier threshold, each against the
# default (15% FP8) and bf16 in the same run. domain-moe, decode-tail perplexity per held-out domain,
# passkeys at 1k/2k/4k. Run from the repository root:  bash scripts/gpu/tiered_sweep.sh
source "$(dirname "$0")/preamble.sh" tiered_sweep
T=tiered:kv_codebook=page
F=kv_tier1_fraction=0.1
timeout 280 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 "$T" "$T:$F" "$T:$F:kv_rank_window=32" "$T:$F:kv_rank_window=128" "$T:$F:kv_rerank_interval=16" \
  "$T:$F:kv_outlier_sigma=3.0" "$T:kv_tier1_fraction=0.12" \
  --out "$OUT/domain_moe_tiered_sweep.json" 2>&1 | grep -v Warn | tail -40
