#!/bin/bash
# The step time and activation bytes of --sequence-parallel against tp without it.
#   bench/sequence_parallel.sh [BIN_DIR]               (default build/release/bin)
#   REPS=5 TP=2 MODEL=llama-small CTX= SEQ=256 BATCH=8 STEPS=8 RECOMPUTE=none bench/sequence_parallel.sh
# TP ranks on this host (trnrun; shm), one compute thread each. REPS launches of each side,
# alternating (off on off on ...). Per launch: the median step time from --metrics-jsonl (the
# first 2 steps left out) and the start-up line's activation bytes. Prints per side the median
# over launches and the ratio of on to off.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
REPS=${REPS:-5}
TP=${TP:-2}
MODEL=${MODEL:-llama-small}
SEQ=${SEQ:-256}
BATCH=${BATCH:-8}
STEPS=${STEPS:-8}
RECOMPUTE=${RECOMPUTE:-none}
CTX=${CTX:-}
out=$(mktemp -d)
# shellcheck source=bench/lib/step_time.sh
source "$(dirname "$0")/lib/step_time.sh"
trap 'rm -rf "$out"' EXIT

run() {
  local side=$1 jsonl=$out/m.jsonl log=$out/log
  rm -f "$jsonl"
  local extra=()
  [ "$side" = on ] && extra=(--sequence-parallel)
  OMPI_ALLOW_RUN_AS_ROOT=1 OPENBLAS_NUM_THREADS=1 TRN_LOG_LEVEL=info "$BIN/trnrun" --nproc-per-node "$TP" -- \
    "$BIN/trn-train" --model "$MODEL" ${CTX:+--ctx "$CTX"} --seq-len "$SEQ" --batch-size "$BATCH" --steps "$STEPS" \
    --log-every "$STEPS" --threads 1 --tp "$TP" --recompute "$RECOMPUTE" --metrics-jsonl "$jsonl" "${extra[@]}" \
    >"$log" 2>&1
  record_run "$side" "$jsonl" "$log" "$out/runs"
}

: >"$out/runs"
for ((rep = 0; rep < REPS; ++rep)); do
  for side in off on; do run "$side"; done
done
/usr/bin/python3 - "$out/runs" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    side, step, act = line.split()
    runs.setdefault(side, []).append((float(step), float(act)))
base = statistics.median(s for s, _ in runs["off"])
print("| --sequence-parallel | step ms (median) | vs off | activations MB | launches (step ms) |")
print("|---|---|---|---|---|")
for side in ("off", "on"):
    steps = [s for s, _ in runs[side]]
    med = statistics.median(steps)
    print(f"| {side} | {med:.1f} | {med / base:.3f} | {runs[side][0][1]:.1f} | {', '.join(f'{s:.0f}' for s in steps)} |")
PY
