#!/bin/bash
# Hierarchical all-reduce (hier) against the flat ring across test-bed hosts (root only).
#   bench/hier_allreduce.sh [BIN_DIR]            (default build/release/bin)
#   REPS=5 HOSTS="2 4" DELAYS="0 1" RAW=rows.txt bench/hier_allreduce.sh
# For H hosts x 2 ranks (tests/multihost/testbed.sh: network namespaces on a bridge, so ranks of
# one host share shm and ranks of different hosts talk tcp over veth) and a delay of 0 or D ms
# on every host's link (a packet between two hosts crosses two links: 2D ms one way), runs
# trn-collbench under mpirun REPS times per algorithm, alternating which goes first, and prints
# the median busbw of each size (4 KiB .. 64 MiB; from the median time, busbw = size / time *
# 2(n-1)/n) and hier's over ring's. RAW keeps every launch's rows (hosts delay algo rep bytes us).
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-5}
HOSTS=${HOSTS:-"2 4"}
DELAYS=${DELAYS:-"0 1"}
[[ $(id -u) == 0 ]] || { echo "hier_allreduce.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=hb$((RANDOM % 100000))
out=$(mktemp -d)
trap '"$TB" down "$name" >/dev/null 2>&1 || true; [[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT

run() {  # hosts delay algo rep
  local h=$1 d=$2 a=$3 rep=$4 iters=20 warm=3
  [[ $d != 0 ]] && iters=5 warm=1  # each operation takes milliseconds there
  "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$RSH" \
    --hostfile "$out/hosts" -np $((2 * h)) --map-by slot -x TRN_LOG_LEVEL=warn -x TRN_FABRIC_PROVIDER=tcp \
    "$BIN/trn-collbench" -b 4K -e 64M -f 4 -n $iters -w $warm -a "$a" 2>&1 |
    awk -v h="$h" -v d="$d" -v a="$a" -v r="$rep" '/^  / { print h, d, a, r, $1, $6 }' >>"$out/rows"
}

for h in $HOSTS; do
  "$TB" up "$name" "$h"
  : >"$out/hosts"
  for ((k = 0; k < h; ++k)); do echo "$name-h$k slots=2" >>"$out/hosts"; done
  for d in $DELAYS; do
    for ((k = 0; k < h; ++k)); do
      if [[ $d == 0 ]]; then "$TB" netem "$name" "$k" ""; else "$TB" netem "$name" "$k" "delay ${d}ms"; fi
    done
    for ((rep = 0; rep < REPS; ++rep)); do
      if ((rep % 2 == 0)); then run "$h" "$d" ring "$rep"; run "$h" "$d" hier "$rep"
      else run "$h" "$d" hier "$rep"; run "$h" "$d" ring "$rep"; fi
    done
    for ((k = 0; k < h; ++k)); do "$TB" netem "$name" "$k" ""; done
  done
  "$TB" down "$name"
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); $REPS launches per side"
/usr/bin/python3 - "$out/rows" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    h, d, a, rep, size, us = line.split()
    runs[(int(h), int(d), int(size), a)].append(float(us))
print("| hosts x ranks | link delay | size | ring busbw GB/s | hier busbw GB/s | hier / ring | launches |")
print("|---|---|---|---|---|---|---|")
for (h, d, size) in sorted({k[:3] for k in runs}):
    ring, hier = runs.get((h, d, size, "ring"), []), runs.get((h, d, size, "hier"), [])
    if not ring or not hier:
        continue
    n = 2 * h
    r, q = (size / statistics.median(x) / 1e3 * 2 * (n - 1) / n for x in (ring, hier))
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    print(f"| {h} x 2 | {d} ms | {label} | {r:.3g} | {q:.3g} | {q / r:.2f} | {len(ring)} + {len(hier)} |")
EOF
