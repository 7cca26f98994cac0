#!/bin/bash
# Busbw of every collective under two builds of trn-collbench, launched alternately (A B, B A,
# ...) so that both sides see the same host: the before/after check of a change to the fabric
# or the algorithms.
#   bench/ab_collbench.sh BEFORE_BIN_DIR AFTER_BIN_DIR
#   REPS=4 RANKS=2 TRANSPORTS="shm tcp" OPS="allreduce allgather ..." ARGS="-b 16K -e 64M -f 4 -n 20 -w 3" \
#     bench/ab_collbench.sh BEFORE AFTER
# Each launch runs one collective over every size (mpirun -np RANKS, TRN_FABRIC_PROVIDER=shm or
# tcp with the rings off). Prints per collective, transport and size the median over launches of
# busbw (from each launch's mean time) and of the p50 busbw (from each launch's median
# operation), after / before for both, and each side's launches, so a ratio below 1 can be told
# from noise: a size is slower beyond noise when after's best launch is below before's worst. A
# build whose trn-collbench prints no p50 column has its mean in the p50 columns.
set -euo pipefail
BEFORE=$(cd "$1" && pwd)
AFTER=$(cd "$2" && pwd)
REPS=${REPS:-4}
RANKS=${RANKS:-2}
TRANSPORTS=${TRANSPORTS:-shm tcp}
OPS=${OPS:-allreduce reducescatter allgather broadcast reduce alltoall}
ARGS=${ARGS:--b 16K -e 64M -f 4 -n 20 -w 3}
out=$(mktemp -d)
trap '[[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

run() {  # side bin transport op
  local side=$1 bin=$2 tr=$3 op=$4 env
  if [[ $tr == shm ]]; then env=(-x TRN_FABRIC_PROVIDER=shm); else env=(-x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_SHM=0); fi
  # shellcheck disable=SC2086
  timeout 600 mpirun --oversubscribe -np "$RANKS" -x TRN_LOG_LEVEL=warn "${env[@]}" \
    "$bin/trn-collbench" -o "$op" $ARGS 2>/dev/null |
    awk -v s="$side" -v t="$tr" -v o="$op" '/^  / { print o, t, s, $1, $6, (NF >= 10 ? $10 : $6) }' >>"$out/rows" ||
    echo "# $side $tr $op: a launch failed (its sizes have one launch fewer)" >&2
}

for tr in $TRANSPORTS; do
  for op in $OPS; do
    for ((rep = 0; rep < REPS; ++rep)); do
      if ((rep % 2 == 0)); then run before "$BEFORE" "$tr" "$op"; run after "$AFTER" "$tr" "$op"
      else run after "$AFTER" "$tr" "$op"; run before "$BEFORE" "$tr" "$op"; fi
    done
  done
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# before $BEFORE, after $AFTER; $RANKS ranks, $ARGS, $REPS launches per side"
/usr/bin/python3 - "$out/rows" "$RANKS" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    op, tr, side, size, us, p50 = line.split()
    runs[(op, tr, int(size), side)].append((float(us), float(p50)))
n = int(sys.argv[2])
# busbw factors as nccl-tests: all-reduce 2(n-1)/n, gathers, scatters and all-to-all (n-1)/n,
# broadcast and reduce 1.
factor = {"allreduce": 2 * (n - 1) / n, "broadcast": 1, "reduce": 1}
print("| collective | transport | size | busbw before / after GB/s | after / before | p50 busbw before / after | p50 after / before | before launches GB/s | after launches GB/s | beyond noise |")
print("|---|---|---|---|---|---|---|---|---|---|")
slower = 0
for op, tr, size in sorted({k[:3] for k in runs}, key=lambda k: (k[0], k[1] != "shm", k[2])):
    b, a = runs.get((op, tr, size, "before"), []), runs.get((op, tr, size, "after"), [])
    if not b or not a:
        continue
    f = factor.get(op, (n - 1) / n)
    bus = lambda us: size / us / 1e3 * f
    bb, ab = [bus(x[0]) for x in b], [bus(x[0]) for x in a]
    bp, ap = [bus(x[1]) for x in b], [bus(x[1]) for x in a]
    mb, ma, pb, pa = map(statistics.median, (bb, ab, bp, ap))
    noise = "slower" if max(ab) < min(bb) else ("faster" if min(ab) > max(bb) else "")
    slower += noise == "slower"
    sz = f"{round(size / 2**20)} MiB" if size >= (1 << 20) - 64 else f"{round(size / 1024)} KiB"
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in sorted(xs))
    print(f"| {op} | {tr} | {sz} | {mb:.2f} / {ma:.2f} | {ma / mb:.2f} | {pb:.2f} / {pa:.2f} | {pa / pb:.2f} | "
          f"{fmt(bb)} | {fmt(ab)} | {noise} |")
print(f"\n{slower} sizes slower beyond noise (after's best launch below before's worst)")
PY
