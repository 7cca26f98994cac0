#!/bin/bash
# trn's all_to_all_v against Open MPI's MPI_Alltoallv on one host, over shm (Open MPI: vader) and
# tcp on loopback (Open MPI: its tcp BTL).
#   bench/all_to_all_v.sh [BIN_DIR]               (default build/release/bin)
#   REPS=6 RANKS=2 TRANSPORTS="shm tcp" OP=alltoallv RAW=rows.txt bench/all_to_all_v.sh
#   BEFORE=/tmp/old-bin bench/all_to_all_v.sh build/release/bin   (A/B: another build's trn-collbench too)
# trn-collbench -o OP (alltoallv: selftest::uneven_counts' pattern) under mpirun -np RANKS, and
# the same with --mpi-anchor, REPS launches per side and transport, alternating which goes first.
# Prints per size (64 KiB .. 64 MiB per rank) the median busbw of the launches (busbw from each
# launch's mean time, factor (n-1)/n), trn's over Open MPI's, the same from the launches' p50
# times (the median operation, which a loaded host's descheduled iterations do not move), and
# the medians of the launches' p50 and p99 times. With BEFORE (a directory holding another build's
# trn-collbench) its launches alternate with the other two (trn, before, mpi; then mpi, before,
# trn) and two columns at the end give its busbw over Open MPI's, by mean and by p50.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
REPS=${REPS:-6}
RANKS=${RANKS:-2}
TRANSPORTS=${TRANSPORTS:-shm tcp}
OP=${OP:-alltoallv}
ARGS=${ARGS:--b 64K -e 64M -f 4 -n 20 -w 3}
out=$(mktemp -d)
trap '[[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

run() {  # transport side rep
  local tr=$1 side=$2 rep=$3 btl env=() extra=()
  if [[ $tr == shm ]]; then btl=self,vader; env=(-x TRN_FABRIC_PROVIDER=shm)
  else btl=self,tcp; env=(-x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_SHM=0); fi
  local bin=$BIN
  [[ $side == mpi ]] && extra=(--mpi-anchor)
  [[ $side == before ]] && bin=$BEFORE_BIN
  # shellcheck disable=SC2086
  timeout 600 mpirun --oversubscribe -np "$RANKS" --mca btl "$btl" -x TRN_LOG_LEVEL=warn "${env[@]}" \
    "$bin/trn-collbench" -o "$OP" $ARGS "${extra[@]}" 2>/dev/null |
    awk -v t="$tr" -v s="$side" -v r="$rep" '/^  / { print t, s, r, $1, $5, $6, $10, $11 }' >>"$out/rows"
}

BEFORE_BIN=
sides=(trn mpi)
if [[ -n ${BEFORE:-} ]]; then BEFORE_BIN=$(cd "$BEFORE" && pwd); sides=(trn before mpi); fi
for tr in $TRANSPORTS; do
  for ((rep = 0; rep < REPS; ++rep)); do
    order=("${sides[@]}")
    if ((rep % 2)); then order=(); for ((i = ${#sides[@]} - 1; i >= 0; --i)); do order+=("${sides[i]}"); done; fi
    for side in "${order[@]}"; do run "$tr" "$side" "$rep"; done
  done
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $RANKS ranks on one host, -o $OP $ARGS, $REPS launches per side"
/usr/bin/python3 - "$out/rows" "$RANKS" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
algo = {}
for line in open(sys.argv[1]):
    tr, side, rep, size, a, us, p50, p99 = line.split()
    runs[(tr, int(size), side)].append((float(us), float(p50), float(p99)))
    if side == "trn":
        algo[(tr, int(size))] = a
n = int(sys.argv[2])
before = any(k[2] == "before" for k in runs)
extra_head, extra_rule = (" before / Open MPI | before p50 ratio |", "---|---|") if before else ("", "")
print("| transport | size per rank | trn algo | trn busbw GB/s | Open MPI busbw GB/s | trn / Open MPI | p50 busbw trn / Open MPI GB/s | p50 ratio | trn p50 / p99 us | Open MPI p50 / p99 us | launches |" + extra_head)
print("|---|---|---|---|---|---|---|---|---|---|---|" + extra_rule)
for tr, size in sorted({(k[0], k[1]) for k in runs}, key=lambda k: (k[0] != "shm", k[1])):
    t, m = runs.get((tr, size, "trn"), []), runs.get((tr, size, "mpi"), [])
    if not t or not m:
        continue
    bus = lambda us: size / us / 1e3 * (n - 1) / n
    tb = statistics.median(bus(x[0]) for x in t)
    mb = statistics.median(bus(x[0]) for x in m)
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    tp, mp = statistics.median(bus(x[1]) for x in t), statistics.median(bus(x[1]) for x in m)
    sz = f"{round(size / 2**20)} MiB" if size >= (1 << 20) - 64 else f"{round(size / 1024)} KiB"
    print(f"| {tr} | {sz} | {algo.get((tr, size), '?')} | {tb:.2f} | {mb:.2f} | {tb / mb:.2f} | {tp:.2f} / {mp:.2f} | {tp / mp:.2f} | "
          f"{med(t, 1):.0f} / {med(t, 2):.0f} | {med(m, 1):.0f} / {med(m, 2):.0f} | {len(t)} + {len(m)} |", end="")
    b = runs.get((tr, size, "before"), [])
    if before and b:
        print(f" {statistics.median(bus(x[0]) for x in b) / mb:.2f} | {statistics.median(bus(x[1]) for x in b) / mp:.2f} |", end="")
    print()
PY
