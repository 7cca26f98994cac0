#!/bin/bash
# The step time of --recompute selective and full against none, one process, one compute thread.
#   bench/recompute_speed.sh [BIN_DIR]                  (default build/release/bin)
#   REPS=5 MODEL=llama-small CTX= SEQ=256 BATCH=8 STEPS=8 PRECISION=fp32 bench/recompute_speed.sh
# REPS launches of each mode, alternating (none selective full none ...). Per launch: the median
# step time from --metrics-jsonl (the first 2 steps left out) and the start-up line's activation
# bytes. Prints per mode the median over launches and its ratio to none's.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
REPS=${REPS:-5}
MODEL=${MODEL:-llama-small}
SEQ=${SEQ:-256}
BATCH=${BATCH:-8}
STEPS=${STEPS:-8}
PRECISION=${PRECISION:-fp32}
CTX=${CTX:-}
out=$(mktemp -d)
# shellcheck source=bench/lib/step_time.sh
source "$(dirname "$0")/lib/step_time.sh"
trap 'rm -rf "$out"' EXIT

run() {
  local mode=$1 jsonl=$out/m.jsonl log=$out/log
  rm -f "$jsonl"
  OPENBLAS_NUM_THREADS=1 TRN_LOG_LEVEL=info "$BIN/trn-train" --model "$MODEL" ${CTX:+--ctx "$CTX"} --seq-len "$SEQ" \
    --batch-size "$BATCH" --steps "$STEPS" --log-every "$STEPS" --threads 1 --precision "$PRECISION" \
    --recompute "$mode" --metrics-jsonl "$jsonl" >"$log" 2>&1
  record_run "$mode" "$jsonl" "$log" "$out/runs"
}

: >"$out/runs"
for ((rep = 0; rep < REPS; ++rep)); do
  for mode in none selective full; do run "$mode"; done
done
echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# trn-train --model $MODEL${CTX:+ --ctx $CTX} --seq-len $SEQ --batch-size $BATCH --steps $STEPS --threads 1" \
  "--precision $PRECISION; $REPS launches per mode, alternating"
/usr/bin/python3 - "$out/runs" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    m, step, act = line.split()
    runs[m].append((float(step), float(act)))
base = statistics.median(s for s, _ in runs["none"])
print("| --recompute | step ms (median) | vs none | activations MB | launches (step ms) |")
print("|---|---|---|---|---|")
for m in ("none", "selective", "full"):
    st = statistics.median(s for s, _ in runs[m])
    print(f"| {m} | {st:.1f} | {st / base:.3f} | {runs[m][0][1]:.1f} | {', '.join(f'{s:.0f}' for s, _ in runs[m])} |")
PY
