#!/bin/bash
# trn's all-reduce over tcp against Open MPI's MPI_Allreduce over its tcp BTL, on one rail of the
# test bed (root only).
#   bench/tcp_anchor.sh [BIN_DIR]            (default build/release/bin)
#   REPS=5 HOSTS=2 RANKS=1 RAW=rows.txt bench/tcp_anchor.sh
# HOSTS test-bed hosts of RANKS ranks each (tests/multihost/testbed.sh), trn-collbench under
# mpirun with TRN_FABRIC_PROVIDER=tcp on eth0, and the same with --mpi-anchor (Open MPI's own
# MPI_Allreduce, `--mca btl tcp,self --mca btl_tcp_if_include eth0`), REPS launches each,
# alternating which goes first. Prints the median busbw of each size (1 MiB .. 64 MiB; from the
# median time, busbw = size / time * 2(n-1)/n) and trn's over Open MPI's.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-5}
HOSTS=${HOSTS:-2}
RANKS=${RANKS:-1}
[[ $(id -u) == 0 ]] || { echo "tcp_anchor.sh: needs root (test-bed namespaces)" >&2; exit 2; }
export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
name=ta$((RANDOM % 100000))
out=$(mktemp -d)
trap '"$TB" down "$name" >/dev/null 2>&1 || true; [[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT

run() {  # side rep
  local side=$1 rep=$2 extra=()
  [[ $side == mpi ]] && extra=(--mpi-anchor)
  "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$RSH" \
    --hostfile "$out/hosts" -np $((HOSTS * RANKS)) --map-by slot --mca btl tcp,self --mca btl_tcp_if_include eth0 \
    -x TRN_LOG_LEVEL=warn -x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_IFACE=eth0 \
    "$BIN/trn-collbench" -b 1M -e 64M -f 4 -n 10 -w 2 "${extra[@]}" 2>&1 |
    awk -v s="$side" -v r="$rep" '/^  / { print s, r, $1, $6 }' >>"$out/rows"
}

"$TB" up "$name" "$HOSTS"
: >"$out/hosts"
for ((k = 0; k < HOSTS; ++k)); do echo "$name-h$k slots=$RANKS" >>"$out/hosts"; done
for ((rep = 0; rep < REPS; ++rep)); do
  if ((rep % 2 == 0)); then run trn "$rep"; run mpi "$rep"; else run mpi "$rep"; run trn "$rep"; fi
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $HOSTS test-bed hosts x $RANKS rank(s), tcp on eth0, $REPS launches per side"
/usr/bin/python3 - "$out/rows" "$((HOSTS * RANKS))" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    side, rep, size, us = line.split()
    runs[(int(size), side)].append(float(us))
n = int(sys.argv[2])
print("| size | trn busbw GB/s | Open MPI busbw GB/s | trn / Open MPI | launches |")
print("|---|---|---|---|---|")
for size in sorted({k[0] for k in runs}):
    t, m = runs.get((size, "trn"), []), runs.get((size, "mpi"), [])
    if not t or not m:
        continue
    a, b = (size / statistics.median(x) / 1e3 * 2 * (n - 1) / n for x in (t, m))
    print(f"| {size >> 20} MiB | {a:.3g} | {b:.3g} | {a / b:.2f} | {len(t)} + {len(m)} |")
PY
