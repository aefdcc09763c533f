#!/bin/bash
# One GPU call (about 4-5 minutes on an H200): nuq2's outlier threshold against the Gluon kernel's time
# (issue 46: kernels within 10% of the 3.5-sigma times 10.5 / 205 / 772 / 61.3 us at (1, 4k), (16, 32k),
# (64, 32k), (1, 128k); passkeys within 2 points of bf16; perplexity <= +5%), docs/decisions.md "nuq2's
# outlier slots: the threshold against the kernel's time". Three settings: nuq2 at its default 3.0 sigma,
# the candidate 3.0 with `kv_outlier_cap=16` (at most 16 slots a page-head and kind, the largest: the kernel's
# first slot chunk, which it runs whatever the count), and 3.5 sigma.
# 1) the Gluon kernel's time at the four shapes on the benchmark's random pages (the issue's targets were
#    taken on them); 2) the same on domain-moe's keys and values (`--pages domain-moe`: what the engine meets,
#    heavier-tailed: benchmarks/quality/nuq2_slots.py); 3) domain-moe's decode-tail perplexity per held-out
#    domain and passkeys at 1k/2k/4k (40 a length) for bf16 and the three, every row in one run.
# Prediction (benchmarks/results/cpu/nuq2_slots_domain-moe.json: the kernel's time fitted linear in the slot
# chunks it runs past its first of each kind, not in the slots used; the two models agree on the H200's
# 3.0 and 3.5 rows and part on the cap), us at (1, 4k) / (16, 32k) / (64, 32k) / (1, 128k):
#  1) random pages: 3.0 ~11.9 / 268 / 1010 / 78, 3.5 ~10.3 / 206 / 779 / 61.5 (as measured before, within 2%),
#     the cap ~10.3 / 206 / 778 / 61.4: within 3% of 3.5's and 10% of the targets at every shape (were the
#     time linear in the slots, the cap's 31.6 would give ~11.2 / 241 / 909 / 71, +15-18% at the 32k-128k ones);
#  2) domain-moe's pages: 3.0 as on random pages (1.79 further chunks a page-head on both; 53 slots against
#     46), 3.5 ~10.8 / 224 / 846 / 66 (0.52 further chunks against 0.01: +8-9% over its random-page time),
#     the cap as on random pages (no further chunk);
#  3) quality: perplexity per domain within +2% of bf16 for all three, the cap within 0.5% of 3.0's per domain
#     (the CPU: +1.4 / +0.9 / +1.4 / +0.2% prose / drama / code / math against 3.0's +1.0 / +0.8 / +1.1 / +0.1%);
#     passkeys 120 of 120 for 3.0 (as the H100 and H200 found) and 119-120 for the cap and for 3.5.
#  tiered_cap16 (tiered with its nuq2 tier capped at 16): within 3% of what tiered's kernel took at 3.5 sigma
#     (254 / 928 us at (16, 32k) / (64, 32k), h200/decode_attention_gluon.json), where tiered at 3.0 takes
#     304 / 1131.
# The cap is nuq2's and tiered's default (16; docs/decisions.md, "nuq2 fills at most 16 outlier slots"): the rows are
# named nuq2_all_slots / tiered_all_slots (every slot, `kv_outlier_cap=1024`), nuq2 / tiered
# (the cap) and nuq2_sigma35; the quality step has tiered with and without the cap beside nuq2's three.
# Run from the repository root:  bash scripts/gpu/nuq2threshold.sh
source "$(dirname "$0")/preamble.sh" nuq2threshold
FORMATS="nuq2_all_slots nuq2 nuq2_sigma35"; SHAPES="1x4096 16x32768 64x32768 1x131072"
# (tiered with and without its nuq2 tier's cap beside them on the random pages: tiered's cache is the benchmark's own)
timeout 120 python benchmarks/kernels/bench_decode_attention.py --formats $FORMATS tiered_all_slots tiered --kernel gluon \
  --configs 0 --shapes $SHAPES --out "$OUT/decode_attention_nuq2_threshold.json" > "$OUT/bench.log" 2>&1
tail -8 "$OUT/bench.log"
timeout 80 python benchmarks/kernels/bench_decode_attention.py --formats $FORMATS --kernel gluon --configs 0 \
  --shapes $SHAPES --pages domain-moe --out "$OUT/decode_attention_nuq2_threshold_domain.json" \
  > "$OUT/bench_domain.log" 2>&1
tail -8 "$OUT/bench_domain.log"
# used slots a page-head and times, both page sets (no new numbers: a summary of the two files above)
python - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("decode_attention_nuq2_threshold.json", "decode_attention_nuq2_threshold_domain.json"):
    path = out / name
    if not path.exists():
        print(f"{name}: missing"); continue
    for r in json.loads(path.read_text())["rows"]:
        if r["format"].startswith(("nuq2", "tiered")) and "ms" in r:
            print(f"{'domain' if 'domain' in name else 'random'} {r['format']:>19} ({r['batch']}, {r['context']}): {r['ms'] * 1e3:8.1f} us, "
                  f"{r.get('used_slots_per_page_head') or 0:5.1f} slots a page-head")
EOF
timeout 130 python benchmarks/quality/domain_model_tables.py --device cuda --ppl-mode decode-tail --tail-windows 2 \
  --formats bf16 nuq2:kv_outlier_cap=1024 nuq2 nuq2:kv_outlier_sigma=3.5 tiered:kv_outlier_cap=1024 tiered \
  --out "$OUT/domain_moe_nuq2_outlier_cap.json" > "$OUT/tables.log" 2>&1
grep -v Warn "$OUT/tables.log" | tail -10
