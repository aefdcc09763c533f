#!/bin/bash
# One GPU call: tiered's fused decode against its reference on the engine's own cache states
# (scripts/tiered_decode_diff.py), then domain-moe's tiered rows (decode-tail perplexity on every
# held-out domain, passkey retrieval at 1k/2k/4k) with today's ranking and with the ranking options
# that found every needle. Run from the repository root: bash scripts/gpu/tiered_tables.sh
source "$(dirname "$0")/preamble.sh" tiered_tables
timeout 150 python scripts/tiered_decode_diff.py > "$OUT/tiered_decode_diff.log" 2>&1; tail -12 "$OUT/tiered_decode_diff.log"
el "tiered diff"
R=kv_codebook=page:kv_rank_window=64:kv_rank_after_prompt=1
timeout 400 python benchmarks/quality/domain_model_tables.py --device cuda --formats bf16 tiered:kv_codebook=page \
  "tiered:$R" "tiered:$R:kv_tier1_fraction=0.1" --ppl-mode decode-tail --tail-windows 2 --tail-tokens 256 \
  --out "$OUT/domain_moe_tiered_tables.json" 2>&1 | grep -v Warn | tail -30
el "tiered tables"
