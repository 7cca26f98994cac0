#!/bin/bash
# MoE training speed: trn-train --model moe-small against the PyTorch MoE of the same shape in its
# usual form (a loop over experts, index_select / index_add: tests/reference/mixtral_reference.py
# bench), one compute thread each.
#   bench/moe.sh [BIN_DIR [BEFORE_BIN_DIR]]      (default build/release/bin)
#   REPS=5 BATCH=4 SEQ=128 STEPS=8 bench/moe.sh
# With BEFORE_BIN_DIR, a second trn-train (another build) runs too, as side "before", alternating
# with the others (trn before torch trn before torch ...), and its ratio to torch is printed too.
# REPS launches of each side, alternating (trn torch trn torch ...). trn: tokens/s of its steps
# after the first two (from --metrics-jsonl elapsed_s), peak RSS from its log; torch: the script's
# tokens/s after its warm-up steps and peak RSS. Prints the medians and their ratio.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
BEFORE=${2:+$(cd "$2" && pwd)}
HERE=$(cd "$(dirname "$0")" && pwd)
REPS=${REPS:-5}
BATCH=${BATCH:-4}
SEQ=${SEQ:-128}
STEPS=${STEPS:-8}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
: >"$out/runs"
# One trn-train run: its tokens/s (past the first two steps) and peak RSS, as "SIDE TOK/S RSS".
trn_run() {
  rm -f "$out/m.jsonl"
  OPENBLAS_NUM_THREADS=1 "$2/trn-train" --model moe-small --batch-size "$BATCH" --seq-len "$SEQ" --steps "$STEPS" \
    --log-every "$STEPS" --threads 1 --metrics-jsonl "$out/m.jsonl" >"$out/log" 2>&1
  /usr/bin/python3 - "$out/m.jsonl" "$out/log" "$BATCH" "$SEQ" "$1" >>"$out/runs" <<'PY'
import json, re, sys
m = [json.loads(l) for l in open(sys.argv[1])]
dt = m[-1]["elapsed_s"] - m[1]["elapsed_s"]
tok = (len(m) - 2) * int(sys.argv[3]) * int(sys.argv[4])
rss = float(re.search(r"peak RSS ([0-9.]+) MB", open(sys.argv[2]).read()).group(1))
print(f"{sys.argv[5]} {tok / dt:.1f} {rss:.0f}")
PY
}
for ((rep = 0; rep < REPS; ++rep)); do
  trn_run trn "$BIN"
  if [[ -n $BEFORE ]]; then trn_run before "$BEFORE"; fi
  OMP_NUM_THREADS=1 /usr/bin/python3 "$HERE/../tests/reference/mixtral_reference.py" bench --model moe-small \
    --batch-size "$BATCH" --seq-len "$SEQ" --steps $((STEPS - 2)) --warmup-bench 2 --threads 1 >"$out/torch" 2>&1
  sed -n 's/.*: \([0-9.]*\) tok\/s, peak RSS \([0-9.]*\) MB/torch \1 \2/p' "$out/torch" >>"$out/runs"
done
echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# moe-small (4 layers, d_model 256, 16 experts of ffn 256, top-4), batch $BATCH x $SEQ, 1 thread;" \
  "$REPS launches per side, alternating"
/usr/bin/python3 - "$out/runs" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    side, tps, rss = line.split()
    runs[side].append((float(tps), float(rss)))
med = {s: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for s, v in runs.items()}
for s in [s for s in ("trn", "before", "torch") if s in runs]:
    print(f"{s:6s} tokens/s median {med[s][0]:8.0f} (runs: {', '.join(f'{t:.0f}' for t, _ in runs[s])}), "
          f"peak RSS {med[s][1]:.0f} MB")
print(f"trn / torch: {med['trn'][0] / med['torch'][0]:.2f}x tokens/s")
if "before" in med:
    print(f"before / torch: {med['before'][0] / med['torch'][0]:.2f}x tokens/s; "
          f"trn / before: {med['trn'][0] / med['before'][0]:.3f}x")
PY
