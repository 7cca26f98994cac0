#!/bin/bash
# Tokens per second of context parallelism against data parallelism at the same tokens per step.
#   bench/context_parallel.sh [BIN_DIR]              (default build/release/bin)
#   REPS=4 N=2 MODEL=llama-small SEQ=8192 BATCH=2 STEPS=5 COMM=ring bench/context_parallel.sh
# N ranks on this host (trnrun; shm), one compute thread each: --dp N against --cp N (--cp-comm
# COMM), BATCH sequences of SEQ tokens per step either way. REPS launches of each side,
# alternating (dp cp dp cp ...). Per launch: the median step time from --metrics-jsonl (the first
# 2 steps left out) and, for cp, the share of the exchange the log says was hidden. Prints per
# side the median over launches and the ratio of cp's tokens/s to dp's.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
REPS=${REPS:-4}
N=${N:-2}
MODEL=${MODEL:-llama-small}
SEQ=${SEQ:-8192}
BATCH=${BATCH:-2}
STEPS=${STEPS:-5}
COMM=${COMM:-ring}
out=$(mktemp -d)
# shellcheck source=bench/lib/step_time.sh
source "$(dirname "$0")/lib/step_time.sh"
trap 'rm -rf "$out"' EXIT

run() {
  local side=$1 jsonl=$out/m.jsonl log=$out/log
  rm -f "$jsonl"
  local layout=(--dp "$N")
  [ "$side" = cp ] && layout=(--cp "$N" --cp-comm "$COMM")
  OMPI_ALLOW_RUN_AS_ROOT=1 OPENBLAS_NUM_THREADS=1 TRN_LOG_LEVEL=info "$BIN/trnrun" --nproc-per-node "$N" -- \
    "$BIN/trn-train" --model "$MODEL" --ctx "$SEQ" --seq-len "$SEQ" --batch-size "$BATCH" --steps "$STEPS" \
    --log-every "$STEPS" --threads 1 --metrics-jsonl "$jsonl" "${layout[@]}" >"$log" 2>&1
  record_run "$side" "$jsonl" "$log" "$out/runs"
  if [ "$side" = cp ]; then
    sed -n 's/.*(\([0-9]*\)% hidden behind attention).*/\1/p' "$log" | head -1 >>"$out/hidden"
  fi
}

: >"$out/runs"
: >"$out/hidden"
for ((rep = 0; rep < REPS; ++rep)); do
  for side in dp cp; do run "$side"; done
done
/usr/bin/python3 - "$out/runs" "$out/hidden" "$BATCH" "$SEQ" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    side, step, _ = line.split()
    runs.setdefault(side, []).append(float(step))
hidden = [int(l) for l in open(sys.argv[2]) if l.strip()]
tokens = int(sys.argv[3]) * int(sys.argv[4])
base = statistics.median(runs["dp"])
print("| layout | step ms (median) | tokens/s | vs dp | launches (step ms) |")
print("|---|---|---|---|---|")
for side in ("dp", "cp"):
    med = statistics.median(runs[side])
    print(f"| {side} | {med:.1f} | {tokens / med * 1e3:.0f} | {base / med:.3f} | {', '.join(f'{s:.0f}' for s in runs[side])} |")
print(f"exchange hidden behind attention (rank 0, per cp launch): {', '.join(f'{h}%' for h in hidden)}")
PY
