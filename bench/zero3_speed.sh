#!/bin/bash
# ZeRO-3's step time against ZeRO-1's on a 2-host test bed, and the share of ZeRO-3's weight
# gathers hidden behind compute (root only).
#   bench/zero3_speed.sh [BIN_DIR]                     (default build/release/bin)
#   REPS=4 MODEL=llama-small STEPS=12 BATCH=8 SEQ=128 RATE= PREFETCH=1 PRECISION=fp32 bench/zero3_speed.sh
# 2 hosts of 2 ranks each (tests/multihost/testbed.sh: one interface per host on a bridge; with
# RATE set, capped at RATE each way by tc tbf), trn-train --dp 4 --threads 1 under mpirun, REPS
# launches of --zero 1 and of --zero 3, alternating (A B A B ...). Per launch: the median step
# time (--metrics-jsonl, the first 2 steps left out) and, for ZeRO-3, its summary line's hidden
# share and exposed wait. Prints the medians per side and ZeRO-3's step over ZeRO-1's.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-4}
MODEL=${MODEL:-llama-small}
STEPS=${STEPS:-12}
BATCH=${BATCH:-8}
SEQ=${SEQ:-128}
RATE=${RATE:-}
PREFETCH=${PREFETCH:-1}
PRECISION=${PRECISION:-fp32}
# EXPORT: more NAME=VALUE settings for every rank (mpirun -x), e.g. EXPORT="TRN_FABRIC_YIELD_US=0".
read -r -a exports <<<"${EXPORT:-}"
xs=()
for e in "${exports[@]}"; do xs+=(-x "$e"); done
[[ $(id -u) == 0 ]] || { echo "zero3_speed.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=z3$((RANDOM % 100000))
out=$(mktemp -d)
trap '"$TB" down "$name" >/dev/null 2>&1 || true; [[ -z ${RAW:-} ]] || cp "$out/runs" "$RAW"; rm -rf "$out"' EXIT

# One launch: zero stage -> a line of $out/runs: stage step_ms hidden_percent waited_ms
run() {
  local z=$1 jsonl=$out/m.jsonl log=$out/log
  rm -f "$jsonl"
  "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$RSH" \
    --hostfile "$out/hosts" -np 4 --map-by slot -x TRN_LOG_LEVEL=info -x TRN_FABRIC_PROVIDER=tcp \
    -x OPENBLAS_NUM_THREADS=1 ${xs[@]+"${xs[@]}"} "$BIN/trn-train" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" \
    --seq-len "$SEQ" --log-every "$STEPS" --dp 4 --threads 1 --zero "$z" --zero-prefetch "$PREFETCH" --precision "$PRECISION" \
    --metrics-jsonl "$jsonl" >"$log" 2>&1
  local step hidden waited
  step=$(/usr/bin/python3 - "$jsonl" <<'PY'
import json, statistics, sys
t = [json.loads(l)["elapsed_s"] for l in open(sys.argv[1]) if '"step"' in l]
d = [b - a for a, b in zip(t, t[1:])][1:]  # per-step times from step 3 on
print(f"{statistics.median(d) * 1e3:.1f}")
PY
)
  hidden=$(sed -n 's/.*ZeRO-3: .* \([0-9]*\)% of gather time hidden.*/\1/p' "$log" | head -1)
  waited=$(sed -n 's/.*compute waited \([0-9.]*\) ms per step for gathers.*/\1/p' "$log" | head -1)
  echo "$z $step ${hidden:-0} ${waited:-0}" >>"$out/runs"
}

if [[ -n $RATE ]]; then "$TB" up "$name" 2 --rails 1 --rate "$RATE"; else "$TB" up "$name" 2; fi
printf '%s slots=2\n' "$name-h0" "$name-h1" >"$out/hosts"
: >"$out/runs"
for ((rep = 0; rep < REPS; ++rep)); do
  run 1
  run 3
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# 2 hosts x 2 ranks${RATE:+, links capped at $RATE}; trn-train --model $MODEL --dp 4 --threads 1" \
  "--batch-size $BATCH --seq-len $SEQ --steps $STEPS --zero-prefetch $PREFETCH --precision $PRECISION${EXPORT:+; $EXPORT}; $REPS launches per side, alternating"
/usr/bin/python3 - "$out/runs" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    w = line.split()
    runs[w[0]].append([float(x) for x in w[1:]])
med = {s: [statistics.median(r[i] for r in rs) for i in range(3)] for s, rs in runs.items()}
print("| --zero | step ms (median) | gather time hidden % | compute waited for gathers ms/step | launches |")
print("|---|---|---|---|---|")
for z in ("1", "3"):
    m = med[z]
    print(f"| {z} | {m[0]:.1f} | {m[1]:.0f} | {m[2]:.2f} | {len(runs[z])} |" if z == "3" else
          f"| {z} | {m[0]:.1f} | - | - | {len(runs[z])} |")
print()
print(f"ZeRO-3 step / ZeRO-1 step: {med['3'][0] / med['1'][0]:.3f}")
print()
print("every launch (stage: step ms, hidden %, waited ms):")
for z in ("1", "3"):
    print(z, "; ".join(f"{r[0]:.0f} {r[1]:.0f} {r[2]:.1f}" for r in runs[z]))
PY
