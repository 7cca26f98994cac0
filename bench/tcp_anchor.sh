#!/bin/bash
# trn's all-reduce over tcp against Open MPI's MPI_Allreduce over its tcp BTL, on one rail of the
# test bed (root only).
#   bench/tcp_anchor.sh [BIN_DIR]            (default build/release/bin)
#   REPS=5 HOSTS=2 RANKS=1 RAW=rows.txt bench/tcp_anchor.sh
#   REPS=8 OP=allreduce ARGS="-b 16K -e 256K -f 4 -n 200 -w 20 -z 1" BIND=none bench/tcp_anchor.sh
# HOSTS test-bed hosts of RANKS ranks each (tests/multihost/testbed.sh), trn-collbench under
# mpirun with TRN_FABRIC_PROVIDER=tcp on eth0, and the same with --mpi-anchor (Open MPI's own
# MPI_Allreduce, `--mca btl tcp,self --mca btl_tcp_if_include eth0`), REPS launches each,
# alternating which goes first. Prints the median busbw of each size (1 MiB .. 64 MiB; from the
# median time, busbw = size / time * 2(n-1)/n) and trn's over Open MPI's.
# OP (allreduce) is trn-collbench's -o (alltoall, alltoallv: busbw = size / time * (n-1)/n); ARGS
# replaces the sizes and iterations; BIND (core, mpirun's default) is mpirun's --bind-to for both
# sides: each test-bed host's orted binds its first rank to core 0 of the same machine, so with
# one rank per host BIND=none lets the OS place them. A second table gives, per size, every
# launch's mean, the largest launch mean over the median launch's, and the median of the
# launches' p50 (the median operation). DELAY_MS (0) puts a netem delay of that many ms on every
# host's link, as plan_validate.py's delayed cases do (2 x DELAY_MS one way between hosts).
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TB=$ROOT/tests/multihost/testbed.sh
RSH=$ROOT/tests/multihost/trn-rsh
REPS=${REPS:-5}
OP=${OP:-allreduce}
ARGS=${ARGS:--b 1M -e 64M -f 4 -n 10 -w 2}
BIND=${BIND:-core}
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
    --hostfile "$out/hosts" -np $((HOSTS * RANKS)) --map-by slot --bind-to "$BIND" --mca btl tcp,self --mca btl_tcp_if_include eth0 \
    -x TRN_LOG_LEVEL=warn -x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_IFACE=eth0 \
    "$BIN/trn-collbench" -o "$OP" $ARGS "${extra[@]}" 2>&1 |
    awk -v s="$side" -v r="$rep" '/^  / { print s, r, $1, $6, $10 }' >>"$out/rows"
}

"$TB" up "$name" "$HOSTS"
if [[ ${DELAY_MS:-0} != 0 ]]; then
  for ((k = 0; k < HOSTS; ++k)); do "$TB" netem "$name" "$k" "delay ${DELAY_MS}ms"; done
fi
: >"$out/hosts"
for ((k = 0; k < HOSTS; ++k)); do echo "$name-h$k slots=$RANKS" >>"$out/hosts"; done
for ((rep = 0; rep < REPS; ++rep)); do
  if ((rep % 2 == 0)); then run trn "$rep"; run mpi "$rep"; else run mpi "$rep"; run trn "$rep"; fi
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $HOSTS test-bed hosts x $RANKS rank(s), tcp on eth0, $REPS launches per side, -o $OP $ARGS, --bind-to $BIND, netem delay ${DELAY_MS:-0} ms a host"
/usr/bin/python3 - "$out/rows" "$((HOSTS * RANKS))" "$OP" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
p50s = collections.defaultdict(list)
for line in open(sys.argv[1]):
    side, rep, size, us, p50 = line.split()
    runs[(int(size), side)].append(float(us))
    p50s[(int(size), side)].append(float(p50))
n = int(sys.argv[2])
factor = 2 * (n - 1) / n if sys.argv[3] == "allreduce" else (n - 1) / n
def shown(size):
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
print("| size | trn busbw GB/s | Open MPI busbw GB/s | trn / Open MPI | launches |")
print("|---|---|---|---|---|")
for size in sorted({k[0] for k in runs}):
    t, m = runs.get((size, "trn"), []), runs.get((size, "mpi"), [])
    if not t or not m:
        continue
    a, b = (size / statistics.median(x) / 1e3 * factor for x in (t, m))
    print(f"| {shown(size)} | {a:.3g} | {b:.3g} | {a / b:.2f} | {len(t)} + {len(m)} |")
print()
print("| side | size | launch means (us) | median launch | worst / median | p50 (median over launches, us) |")
print("|---|---|---|---|---|---|")
for size in sorted({k[0] for k in runs}):
    for side in ("trn", "mpi"):
        x = sorted(runs.get((size, side), []))
        if not x:
            continue
        med = statistics.median(x)
        print(f"| {side} | {shown(size)} | {', '.join(f'{v:.1f}' for v in x)} | {med:.1f} | {x[-1] / med:.2f} | "
              f"{statistics.median(p50s[(size, side)]):.1f} |")
PY
