# Shared by the step-time benchmarks (bench/recompute_speed.sh, bench/sequence_parallel.sh):
#   record_run LABEL JSONL LOG RUNS
# appends "LABEL STEP_MS ACTIVATIONS_MB" to RUNS: the median step time of a trn-train run from its
# --metrics-jsonl (the first 2 steps left out: the first carries start-up, the second its
# wake) and the start-up line's activation bytes from its log.
record_run() {
  local label=$1 jsonl=$2 log=$3 runs=$4 step act
  step=$(/usr/bin/python3 - "$jsonl" <<'PY'
import json, statistics, sys
t = [json.loads(l)["elapsed_s"] for l in open(sys.argv[1]) if '"step"' in l]
d = [b - a for a, b in zip(t, t[1:])][1:]
print(f"{statistics.median(d) * 1e3:.1f}")
PY
)
  act=$(sed -n 's/.*parameters on this rank, \([0-9.]*\) MB activations.*/\1/p' "$log" | head -1)
  echo "$label $step $act" >>"$runs"
}
