#!/bin/bash
# One GPU call (< 9 min on an H100) that trains domain-mla (DeepSeek-V3 architecture: MLA, a dense first
# layer, 32 experts top-4 plus a shared expert, 4 groups of which a token keeps 2) and its flat-routed
# twin (--n-group 1 --topk-group 1, every other parameter the same), each with domain-moe's data, passkey
# rows and recipe at half its token budget, then checks both against transformers and, in the time left,
# runs the routing experiment (benchmarks/quality/group_routing.py). Every step leaves its results in
# $OUT before the next starts (7 files: per model its weight part(s) and run.tar; parity.txt, routing.json,
# and the log the caller tees), so a call cut short keeps what finished.
#
# Prepare the carried data here (the device has no ../shared/data), from the repository root:
#   python scripts/prepare_domain_data.py --out /tmp/dd/data            # ~1 min; tokenizer = the shipped one
#   mkdir -p .device_out && tar cf - -C /tmp/dd data | xz -9e > .device_out/data.tar.xz    # ~5 MB
# carry .device_out (git-ignored) and run from the repository root:
#   DATA=.device_out/data.tar.xz bash scripts/gpu/mla_train.sh 2>&1 | tee $OUT/log
# Rehearse on the CPU (toy models, a few steps, ~3 min on 2 cores):
#   python scripts/prepare_domain_data.py --out /tmp/dsmoke --smoke
#   SMOKE=1 DATA_DIR=/tmp/dsmoke OUT=/tmp/mla_out bash scripts/gpu/mla_train.sh
# Knobs: N_GROUP / TOPK_GROUP (4 / 2), TOKENS (98304000: 750 steps of 131,072), TIME_BUDGET (seconds of
# training per model, evaluations included: 185), ROUTING=0 skips the routing experiment.
# How its results became the tree's: models/domain-mla from $OUT/grouped (the parts joined: cat
# model.safetensors.part* > model.safetensors; run.tar's config.json, train_log.jsonl, eval.json,
# loss_curve.png), the tokenizer files from /tmp/dd/data (byte-identical to models/domain-moe's), and
# the figures of its README.md from eval.json and the routing experiment; the flat twin's weights stay
# out of the tree, its eval.json and train_log.jsonl are in benchmarks/results/h100/domain-mla-flat/,
# routing.json is benchmarks/results/h100/group_routing_domain-mla.json (docs/routing.md's table).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:=/tmp/mla_train}"; mkdir -p "$OUT"
DEV=cuda; TOKENS=${TOKENS:-98304000}; TB=${TIME_BUDGET:-185}; NG=${N_GROUP:-4}; TG=${TOPK_GROUP:-2}
LIMIT=530  # seconds for the whole call: the routing experiment gets what the rest leaves
TRAIN_X=(); ROUTE_X=(--dtype bfloat16); PARITY_TEXT=prose.txt
if [ -n "$SMOKE" ]; then DEV=cpu; TRAIN_X=(--smoke --device cpu); LIMIT=600
  ROUTE_X=(--max-tokens 512 --window 256 --max-model-len 512 --retrieval-lengths 256 --retrieval-depths 0.5
           --retrieval-trials 1); fi
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
[ "$DEV" = cuda ] && nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "$DATA_DIR" ]; then
  mkdir -p /tmp/d && tar xJf "${DATA:-data.tar.xz}" -C /tmp/d || exit 2
  DATA_DIR=/tmp/d/data; el untarred
fi
# domain-moe's recipe (scripts/domain_moe_device_call.sh) at half its token budget: 20-pass cap, the short
# first length held until the passkey answer loss is below 0.3 nats (at most 60% of the run) at the peak lr,
# 35% passkey rows, no copy rows
RECIPE=(--arch deepseek-v3 --data "$DATA_DIR" --token-budget "$TOKENS" --max-passes 20
        --curriculum 512:0.3,1024:0.2,2048:0.2,4096:0.3 --curriculum-gate 0.3 --curriculum-gate-max 0.6
        --warmup 0.064 --hold-lr-until-gate --copy-frac 0 --passkey-frac 0.35 --eval-every-tokens 24e6)

train() {  # name, extra flags...: train into /tmp/runs/name, then its files into $OUT/name and /tmp/models/name
  local name=$1; shift
  python scripts/train_domain_moe.py "${RECIPE[@]}" --out /tmp/runs/$name "$@" "${TRAIN_X[@]}" \
    > /tmp/runs/$name.log 2>&1
  local rc=$?
  grep -E "^\[(train|eval|done)\]" /tmp/runs/$name.log | grep -v "Writing model" | tail -4
  mkdir -p "$OUT/$name" /tmp/models/$name
  cp /tmp/runs/$name/model.safetensors.part* "$OUT/$name/" 2>/dev/null
  cp /tmp/runs/$name.log /tmp/runs/$name/train.log
  (cd /tmp/runs/$name && tar cf "$OUT/$name/run.tar" config.json train_log.jsonl eval.json train.log \
    $(ls loss_curve.png 2>/dev/null))
  cat /tmp/runs/$name/model.safetensors.part* > /tmp/models/$name/model.safetensors
  cp /tmp/runs/$name/config.json "$DATA_DIR"/tokenizer.json "$DATA_DIR"/tokenizer_config.json \
    "$DATA_DIR"/special_tokens_map.json /tmp/models/$name/
  return $rc
}
mkdir -p /tmp/runs
train grouped --n-group "$NG" --topk-group "$TG" --time-budget-s "$TB" || { el "grouped training failed"; exit 3; }
el "grouped trained"
# the twin takes as many steps as the grouped model took (a time budget may have cut it), a little more time
STEPS=$(python -c "import json; print(json.load(open('/tmp/runs/grouped/eval.json'))['steps'])")
train flat --n-group 1 --topk-group 1 --max-steps "$STEPS" --time-budget-s $((TB + 15)) || { el "flat training failed"; exit 3; }
el "flat trained"
for name in grouped flat; do  # the engine against transformers (float32, CPU), then greedy text from the engine
  timeout 60 python scripts/hf_parity_check.py --model /tmp/models/$name --text "$DATA_DIR/heldout/$PARITY_TEXT" \
    2>/dev/null | tail -1 | sed "s/^/$name /" >> "$OUT/parity.txt"
  timeout 60 python -m moekv.cli generate --model /tmp/models/$name --prompt "def main(" --max-tokens 16 --device $DEV \
    2>/dev/null | head -3 | sed "s/^/$name generate: /" >> "$OUT/parity.txt"
done
cat "$OUT/parity.txt"; el "parity"
LEFT=$(( LIMIT - ($(date +%s) - T0) ))
if [ "${ROUTING:-1}" = 1 ] && [ "$LEFT" -gt 45 ]; then
  timeout $((LEFT - 10)) python benchmarks/quality/group_routing.py --model grouped=/tmp/models/grouped \
    --model flat=/tmp/models/flat --heldout "$DATA_DIR/heldout" --device $DEV "${ROUTE_X[@]}" \
    --out "$OUT/routing.json" 2>&1 | grep -v Warning | tail -30
  el "routing experiment"
else
  el "routing experiment left for the CPU ($LEFT s left)"
fi
