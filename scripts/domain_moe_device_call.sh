#!/bin/bash
# One GPU call that retrains models/domain-moe and re-measures its KV tables (issue 23). Every step
# leaves its results in $OUT before the next starts (8 files: 2 weight parts, run.tar, calib.tar,
# three table JSONs, log), so a call cut short keeps what finished.
#
# Prepare the carried folder here (the device has no ../shared/data), from the repository root:
#   python scripts/prepare_domain_data.py --out /tmp/dd/data            # ~40 s; tokenizer = the shipped one
#   tar cf - -C /tmp/dd data | xz -9e > data.tar.xz                     # 4.8 MB
#   PYTHONPATH=. python -c "from pathlib import Path; import sys; sys.path.insert(0, 'benchmarks/quality'); \
#     from domain_routing import calibration_files as c; \
#     Path('calib.txt').write_text('\n\n'.join(p.read_text() for p in c(Path('/tmp/dd/calib'), 40000)))"
# then copy moekv/, scripts/, benchmarks/quality/, models/domain-moe (without model.safetensors),
# data.tar.xz and calib.txt into a git-ignored folder of the checkout, carry it, and run there:
#   bash scripts/domain_moe_device_call.sh 2>&1 | tee $OUT/log
# SMOKE=1 OUT=/tmp/out bash scripts/domain_moe_device_call.sh   rehearses it on CPU (toy model, ~2 min).
# TRAIN_ONLY=1 stops after training (weights and log in $OUT); TABLES_ONLY=1 skips training and measures
# the tables of the weights already in models/domain-moe (two calls when training takes most of one).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
DEV=cuda; PK_MIN=0.95; TRAIN_X=(); CAL_X=(--max-tokens 32768); TAB_X=(); DEC_X=(--tail-windows 2)
if [ -n "$SMOKE" ]; then DEV=cpu; PK_MIN=0; TRAIN_X=(--smoke --device cpu); CAL_X=(--max-tokens 1024 --window 512)
  TAB_X=(--lengths 512 --depths 0.5 --trials 1 --ppl-max-tokens 256); DEC_X=(--lengths 512 --tail-windows 1 --tail-tokens 8); fi
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
if [ -z "$TABLES_ONLY" ]; then
mkdir -p /tmp/d && tar xJf data.tar.xz -C /tmp/d && el untarred
# 20 passes over every domain (the cap, in proportion to their sizes: no fill domain needed); the short
# first length is held until the passkey answer loss is below 0.3 nats (at most 60% of the run), at the
# peak lr after a 96-step warmup (as in the shipped run's first 500 steps, where its lookup formed); the
# cosine runs over what is left after the gate. 35% passkey rows whose answer includes the '.' after
# the key (without it a model retrieves the key but runs on with more digits); no copy rows: random
# spans do not teach this model size to copy (the loss on their repeats stays at a uniform guess)
python scripts/train_domain_moe.py --data /tmp/d/data --out /tmp/run --token-budget 196608000 --time-budget-s 260 \
    --max-passes 20 --curriculum 512:0.3,1024:0.2,2048:0.2,4096:0.3 --curriculum-gate 0.3 \
    --curriculum-gate-max 0.6 --warmup 0.064 --hold-lr-until-gate --copy-frac 0 --passkey-frac 0.35 \
    --eval-every-tokens 16e6 "${TRAIN_X[@]}"
el trained
cp /tmp/run/model.safetensors.part* $OUT/ && (cd /tmp/run && tar cf $OUT/run.tar config.json train_log.jsonl eval.json loss_curve.png)
python -c "import json, sys; e = json.load(open('/tmp/run/eval.json')); a = e['passkey']['by_length']; \
print('[call] passkey', a); sys.exit(0 if min(a.values()) >= $PK_MIN else 4)" || { el "no retrieval: tables skipped"; exit 4; }
[ -n "$TRAIN_ONLY" ] && { el "TRAIN_ONLY: tables left for a call of their own (TABLES_ONLY=1)"; exit 0; }
cat /tmp/run/model.safetensors.part* > models/domain-moe/model.safetensors && cp /tmp/run/config.json models/domain-moe/ || exit 3
fi
timeout 100 python -m moekv.cli calibrate --model models/domain-moe --text calib.txt --out models/domain-moe/kv_calibration \
    --window 4096 --device $DEV --quiet "${CAL_X[@]}"
el calibrated
tar cf $OUT/calib.tar -C models/domain-moe kv_calibration
B=benchmarks/quality/domain_model_tables.py
timeout 170 python $B --device $DEV "${TAB_X[@]}" --formats bf16 fp8_e4m3 int4 nuq2 tiered:kv_rerank_interval=1:kv_codebook=page --out $OUT/tables_a.json
el tables_a
timeout 90 python $B --device $DEV "${DEC_X[@]}" --ppl-mode decode-tail --no-retrieval --formats bf16 tiered:kv_codebook=page fp8_e4m3 --out $OUT/tables_decode.json
el tables_decode
python $B --device $DEV "${TAB_X[@]}" --formats kivi2 nuq2:kv_codebook=page vq --out $OUT/tables_b.json
el done
