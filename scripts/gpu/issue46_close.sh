#!/bin/bash
# One GPU call (about 7 minutes; first run on an H100: benchmarks/results/h100/domain_moe_kv_tables_defaults.json,
# decode_attention_defaults.json) for issue 46's formats as they ship, through their Gluon kernels:
# 1. domain-moe's decode-tail perplexity per held-out domain and passkeys at 1k/2k/4k (40 a length) for bf16,
#    nuq2 (window 128, outliers beyond 3.0 sigma, at most 16 a page-head and kind), nuq2 with a 256-token
#    window (the ~3-bit setting: 2.47 bits a token at 32k as slabs), tiered (its nuq2 tier filling every slot)
#    and tiered with nuq2's cap of 16; kivi2, vq (window 256) and vq with a 512-token window (1.47 bits a token
#    at 32k, 3.44 at 4k: below kivi2's 3.09 / 3.75; on the CPU ahead of kivi2 on every domain);
# 2. the Gluon decode-attention table of nuq2 (no window, the cap), nuq2_r128 and nuq2_r256 (the windows),
#    nuq2_all_slots, tiered and tiered_cap16, kivi2, int4 and vq at (1, 4k), (16, 32k), (64, 32k), (1, 128k),
#    SDPA beside (the README's speed-up row at the defaults), vq_r256 / vq_r512 with their rings.
# Prediction (on an H200, from the H100's run): 1) as the H100: nuq2 +0.15..+1.62%, the 256 window
#    +0.25..+1.01%, tiered +0.18..+0.82%, tiered capped +0.22..+1.51%, 120 of 120 each; 2) nuq2 ~10.4 / 202 /
#    778 / 61 us (the kernel is issue-bound: the same on both GPUs), the windows within 2% of it, tiered ~15.2 /
#    308 / 1145 / 101, tiered_cap16 ~13.5 / 251 / 924 / 85; vq_r512 within 8% of vq_r256 (its ring adds ~9% of
#    the bytes at 32k). Quality: kivi2 and vq as the H100 measured them (+2.0% / +2.9% worst); vq with 512 as
#    the CPU: worst +0.9% (code), every passkey.
# Each step writes its file to $OUT before the next starts. Run from the repository root:
#   bash scripts/gpu/issue46_close.sh
source "$(dirname "$0")/preamble.sh" issue46_close
timeout 260 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 nuq2 nuq2:kv_residual=256 tiered tiered:kv_outlier_cap=16 kivi2 vq vq:kv_residual=512 \
  --out "$OUT/domain_moe_kv_tables_defaults.json" > "$OUT/tables.log" 2>&1
grep -v Warn "$OUT/tables.log" | tail -6; el "domain-moe tables"
timeout 200 python benchmarks/kernels/bench_decode_attention.py --kernel gluon --configs 0 \
  --formats nuq2 nuq2_r128 nuq2_r256 nuq2_all_slots tiered tiered_cap16 kivi2 int4 vq vq_r256 vq_r512 \
  --shapes 1x4096 16x32768 64x32768 1x131072 --out "$OUT/decode_attention_defaults.json" > "$OUT/bench.log" 2>&1
grep -E "^\(|kernel:" "$OUT/bench.log" | grep -v "register\|shared" | tail -40; el "Gluon kernel table"
