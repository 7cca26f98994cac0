#!/bin/bash
# Expert parallelism's all-to-alls against the step, on a 2-host test bed (root only).
#   bench/moe_ep.sh [BIN_DIR]                         (default build/release/bin)
#   REPS=3 EPS="1 2 4" MODEL=moe-small STEPS=10 BATCH=8 SEQ=128 BIND=none PER_HOST=2 RATE= EXTRA= RAW=runs.txt KEEP=dir bench/moe_ep.sh
# 2 hosts of PER_HOST ranks each (tests/multihost/testbed.sh: one interface per host on a bridge;
# with RATE set, capped at RATE each way by tc tbf), a trn-coordinator in host 0 and one trnrun
# per host (--nnodes 2 --nproc-per-node PER_HOST, --bind BIND), trn-train --model MODEL
# --dp 2xPER_HOST --ep E --threads 1 over tcp between the hosts (shm within one). REPS rounds, each launching every E of
# EPS in turn (1 2 4 1 2 4 ...). Per launch: the median step time (--metrics-jsonl, the first 2
# steps left out), tokens/s from it (BATCH x SEQ tokens a step) and, for E > 1, rank 0's summary
# line: the all-to-alls' share of the step time and their ms per step (both over every step,
# the first included, as trn-train counts them). Prints the medians per E; RAW keeps every
# launch's figures, KEEP every launch's rank logs and metrics (KEEP/ep<E>-<launch>/).
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
REPS=${REPS:-3}
EPS=${EPS:-1 2 4}
MODEL=${MODEL:-moe-small}
STEPS=${STEPS:-10}
BATCH=${BATCH:-8}
SEQ=${SEQ:-128}
BIND=${BIND:-none}
PER_HOST=${PER_HOST:-2}
DP=$((2 * PER_HOST))
RATE=${RATE:-}
# EXTRA: more trn-train flags for every launch, e.g. EXTRA="--capacity-factor 1".
read -r -a extra <<<"${EXTRA:-}"
[[ $(id -u) == 0 ]] || { echo "moe_ep.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=ep$((RANDOM % 100000))
out=$(mktemp -d)
coord=
cleanup() {
  [[ -z $coord ]] || kill "$coord" 2>/dev/null || true
  "$TB" down "$name" >/dev/null 2>&1 || true
  [[ -z ${RAW:-} ]] || cp "$out/runs" "$RAW"
  rm -rf "$out"
}
trap cleanup EXIT

if [[ -n $RATE ]]; then "$TB" up "$name" 2 --rails 1 --rate "$RATE"; else "$TB" up "$name" 2; fi
addr0=$("$TB" addr "$name" 0)
"$TB" exec "$name" 0 "$BIN/trn-coordinator" --listen "$addr0:0" --port-file "$out/port" >"$out/coord.log" 2>&1 &
coord=$!
for ((i = 0; i < 300; ++i)); do [[ -s $out/port ]] && break; sleep 0.1; done
[[ -s $out/port ]] || { echo "moe_ep.sh: the coordinator did not start: $(cat "$out/coord.log")" >&2; exit 1; }
coordinator=$addr0:$(tr -d ' \n' <"$out/port")

# One launch: ep -> a line of $out/runs: ep step_ms tokens_per_s a2a_percent a2a_ms
launch=0
run() {
  local ep=$1 jsonl=$out/m.jsonl logs=$out/logs job=ep$1-$((++launch))
  rm -rf "$jsonl" "$logs"
  mkdir -p "$logs"
  local pids=()
  for k in 0 1; do
    "$TB" exec "$name" "$k" env TRN_LOG_LEVEL=info TRN_FABRIC_PROVIDER=tcp OPENBLAS_NUM_THREADS=1 \
      "$BIN/trnrun" --coordinator "$coordinator" --job-id "$job" --nnodes 2 --nproc-per-node "$PER_HOST" --node-rank "$k" \
      --bind "$BIND" --log-dir "$logs" -- \
      "$BIN/trn-train" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" --seq-len "$SEQ" \
      --log-every "$STEPS" --dp "$DP" --ep "$ep" --threads 1 ${extra[@]+"${extra[@]}"} --metrics-jsonl "$jsonl" >"$out/node$k.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  if ((rc != 0)) || [[ ! -s $jsonl ]]; then
    echo "moe_ep.sh: the launch at --ep $ep failed (exit $rc):" >&2
    tail -n 20 "$out"/node*.log "$logs"/* >&2 || true
    exit 1
  fi
  local step line
  step=$(/usr/bin/python3 - "$jsonl" "$BATCH" "$SEQ" <<'PY'
import json, statistics, sys
t = [json.loads(l)["elapsed_s"] for l in open(sys.argv[1]) if '"step"' in l]
d = [b - a for a, b in zip(t, t[1:])][1:]  # per-step times from step 3 on
s = statistics.median(d)
print(f"{s * 1e3:.1f} {int(sys.argv[2]) * int(sys.argv[3]) / s:.0f}")
PY
)
  line=$(cat "$logs"/rank0.gen*.log | sed -n 's/.*MoE all-to-alls took \([0-9.]*\)% of the step time (\([0-9.]*\) ms per step).*/\1 \2/p' | head -1)
  if ((ep > 1)) && [[ -z $line ]]; then
    echo "moe_ep.sh: no all-to-all line in rank 0's log at --ep $ep" >&2
    exit 1
  fi
  echo "$ep $step ${line:-0 0}" >>"$out/runs"
  [[ -z ${KEEP:-} ]] || { mkdir -p "$KEEP/$job" && cp "$logs"/* "$jsonl" "$KEEP/$job/"; }
}

: >"$out/runs"
load_start=$(cut -d' ' -f1-3 /proc/loadavg)
for ((rep = 0; rep < REPS; ++rep)); do
  for ep in $EPS; do run "$ep"; done
done

echo "# $(uname -n), $(nproc) cores, load average at the start: $load_start, at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# 2 hosts x $PER_HOST ranks${RATE:+, links capped at $RATE}, trnrun --bind $BIND; trn-train --model $MODEL --dp $DP --threads 1" \
  "--batch-size $BATCH --seq-len $SEQ --steps $STEPS${EXTRA:+ $EXTRA}; $REPS launches per ep, alternating ($EPS)"
/usr/bin/python3 - "$out/runs" "$EPS" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    w = line.split()
    runs[w[0]].append([float(x) for x in w[1:]])
print("| --ep | tokens/s (median) | step ms (median) | all-to-alls % of step (median) | all-to-alls ms/step (median) | launches |")
print("|---|---|---|---|---|---|")
for ep in sys.argv[2].split():
    rs = runs[ep]
    m = [statistics.median(r[i] for r in rs) for i in range(4)]
    a2a = ("-", "-") if ep == "1" else (f"{m[2]:.1f}", f"{m[3]:.1f}")
    print(f"| {ep} | {m[1]:.0f} | {m[0]:.1f} | {a2a[0]} | {a2a[1]} | {len(rs)} |")
print()
print("every launch (ep: step ms, tokens/s, a2a %, a2a ms/step):")
for ep in sys.argv[2].split():
    print(ep, "; ".join(f"{r[0]:.0f} {r[1]:.0f} {r[2]:.1f} {r[3]:.1f}" for r in runs[ep]))
PY
