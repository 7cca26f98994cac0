#!/bin/bash
# A training step's communication over one rail against two, on a test bed whose rails are capped
# NICs (root only).
#   bench/rails_training.sh [BIN_DIR]                 (default build/release/bin)
#   REPS=5 RATE=100mbit MODEL=small STEPS=10 BATCH=8 SEQ=256 RAW=runs.txt bench/rails_training.sh
# 2 hosts of one rank each, 2 rails per host (tests/multihost/testbed.sh --rails 2: an interface
# per rail on a switch of its own, each link capped at RATE both ways by tc tbf). trn-train
# --dp 2 runs under mpirun with TRN_FABRIC_RAILS=eth0 (one rail) and eth0,eth1 (two), REPS
# launches of each, alternating (A B A B ...). The step's communication is the time it waited
# for its gradients after backward (trn-train's summary): small's 13 MB of gradients fit one
# 25 MiB bucket, which starts when backward ends, so no compute hides any of it. Also per launch:
# the median step time (--metrics-jsonl, the first 2 steps left out), one blocking all-reduce of
# all gradients (trn-train's summary) and the bytes each host sent on each rail. Prints the
# medians per side and two rails' over one's. RAW keeps every launch's figures.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-5}
RATE=${RATE:-100mbit}
MODEL=${MODEL:-small}
STEPS=${STEPS:-10}
BATCH=${BATCH:-8}
SEQ=${SEQ:-256}
[[ $(id -u) == 0 ]] || { echo "rails_training.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=rt$((RANDOM % 100000))
out=$(mktemp -d)
trap '"$TB" down "$name" >/dev/null 2>&1 || true; [[ -z ${RAW:-} ]] || cp "$out/runs" "$RAW"; rm -rf "$out"' EXIT

tx() {  # host iface -> bytes sent so far (/proc/net/dev follows the namespace)
  "$TB" exec "$name" "$1" cat /proc/net/dev | awk -v d="$2:" '$1 == d { print $10 }'
}

# One launch: side (eth0 or eth0,eth1) -> a line of $out/runs:
# side step_ms waited_ms allreduce_ms h0eth0 h0eth1 h1eth0 h1eth1
run() {
  local side=$1 jsonl=$out/m.jsonl log=$out/log
  local before=() after=()
  rm -f "$jsonl"
  for k in 0 1; do for i in eth0 eth1; do before+=("$(tx $k $i)"); done; done
  "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$RSH" \
    --hostfile "$out/hosts" -np 2 --map-by slot -x TRN_LOG_LEVEL=info -x TRN_FABRIC_PROVIDER=tcp \
    -x TRN_FABRIC_RAILS="$side" "$BIN/trn-train" --model "$MODEL" --steps "$STEPS" --batch-size "$BATCH" \
    --seq-len "$SEQ" --log-every "$STEPS" --dp 2 --metrics-jsonl "$jsonl" >"$log" 2>&1
  for k in 0 1; do for i in eth0 eth1; do after+=("$(tx $k $i)"); done; done
  local step waited ar
  step=$(/usr/bin/python3 - "$jsonl" <<'PY'
import json, statistics, sys
t = [json.loads(l)["elapsed_s"] for l in open(sys.argv[1]) if '"step"' in l]
d = [b - a for a, b in zip(t, t[1:])][1:]  # per-step times from step 3 on
print(f"{statistics.median(d) * 1e3:.1f}")
PY
)
  waited=$(sed -n 's/.*the step waited \([0-9.]*\) ms.*/\1/p' "$log" | head -1)
  ar=$(sed -n 's/.*all-reduce of all gradients: \([0-9.]*\) ms.*/\1/p' "$log" | head -1)
  echo "$side $step ${waited:-0} ${ar:-0} $((after[0] - before[0])) $((after[1] - before[1])) \
$((after[2] - before[2])) $((after[3] - before[3]))" >>"$out/runs"
}

"$TB" up "$name" 2 --rails 2 --rate "$RATE"
printf '%s slots=1\n' "$name-h0" "$name-h1" >"$out/hosts"
: >"$out/runs"
for ((rep = 0; rep < REPS; ++rep)); do
  run eth0
  run eth0,eth1
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# 2 hosts x 1 rank, 2 rails per host capped at $RATE each way; trn-train --model $MODEL --dp 2" \
  "--batch-size $BATCH --seq-len $SEQ --steps $STEPS; $REPS launches per side, alternating"
/usr/bin/python3 - "$out/runs" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    w = line.split()
    runs[w[0]].append([float(x) for x in w[1:]])
med = {s: [statistics.median(r[i] for r in rs) for i in range(7)] for s, rs in runs.items()}
print("| rails | communication (waited after backward) ms | step ms | blocking all-reduce of all gradients ms "
      "| host 0 eth0 MB | host 0 eth1 MB | launches |")
print("|---|---|---|---|---|---|---|")
for side in ("eth0", "eth0,eth1"):
    m = med[side]
    print(f"| {side} | {m[1]:.1f} | {m[0]:.1f} | {m[2]:.1f} | {m[3] / 1e6:.1f} | {m[4] / 1e6:.1f} | {len(runs[side])} |")
one, two = med["eth0"], med["eth0,eth1"]
print()
print(f"two rails / one: communication {two[1] / one[1]:.2f}, step {two[0] / one[0]:.2f}, "
      f"blocking all-reduce {two[2] / one[2]:.2f}")
print()
print("every launch (rails, step ms, waited ms, all-reduce ms):")
for side in ("eth0", "eth0,eth1"):
    print(side, "; ".join(f"{r[0]:.0f} {r[1]:.0f} {r[2]:.0f}" for r in runs[side]))
PY
