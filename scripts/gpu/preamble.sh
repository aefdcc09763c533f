# The start every script here shares; each sources it first (run from the repository root):
#     source "$(dirname "$0")/preamble.sh" NAME [FIELDS]
# pipefail; Python unbuffered and importing this checkout (PYTHONPATH=.); OUT, the results folder,
# taken from the environment or /tmp/NAME, created; el LABEL prints "[call] LABEL at Ns", the seconds
# since this ran; the device line, nvidia-smi's FIELDS (default name), printed and kept in $OUT/device.txt.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
: "${OUT:=/tmp/${1:?preamble.sh: name the default results folder (/tmp/NAME)}}"; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[call] $1 at $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu="${2:-name}" --format=csv,noheader | tee "$OUT/device.txt"
