#!/bin/bash
# The data-parallel gradient all-reduce with each wire format: f32, bf16 (-d bf16) and e4m3
# (--wire e4m3), the same number of f32 gradients each, REPS launches of each side alternating
# under mpirun; prints the median time per all-reduce (us) as a markdown table, with each
# format's speed-up over f32. Operations are issued back to back and the last awaited, as the
# trainer's buckets are.
#   bench/fp8_allreduce.sh [BIN_DIR]                  shm and tcp on this host, 2 and 4 ranks
#   sudo BED="2 4" DELAY=1 bench/fp8_allreduce.sh     across 2 and 4 test-bed hosts, one rank each,
#                                                     tcp over veth, DELAY ms on every host's link
#   env: REPS (5), ITERS (20 on one host, 5 across test-bed hosts), MIN (256K), MAX (16M) gradients
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPS=${REPS:-5}
MIN=$(numfmt --from=iec "${MIN:-256K}"); MAX=$(numfmt --from=iec "${MAX:-16M}")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
TB=$ROOT/tests/multihost/testbed.sh
name=fb$((RANDOM % 100000))
trap '[[ -z ${BED:-} ]] || "$TB" down "$name" >/dev/null 2>&1 || true; rm -rf "$out"' EXIT

args_of() {
  case $1 in
    f32) echo "-d f32 -b $((MIN * 4)) -e $((MAX * 4))" ;;
    bf16) echo "-d bf16 -b $((MIN * 2)) -e $((MAX * 2))" ;;
    e4m3) echo "-d f32 --wire e4m3 -b $((MIN * 4)) -e $((MAX * 4))" ;;
  esac
}
collect() {  # label ranks wire: reads trn-collbench rows on stdin
  grep -v '^#' | awk -v t="$1" -v n="$2" -v w="$3" '{print t, n, w, $2, $6}' >>"$out/rows"
}

if [[ -z ${BED:-} ]]; then
  for tr in shm tcp; do
    if [[ $tr == shm ]]; then envs="-x TRN_FABRIC_PROVIDER=shm"; else envs="-x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_SHM=0"; fi
    for n in 2 4; do
      for rep in $(seq "$REPS"); do
        for w in f32 bf16 e4m3; do
          timeout 600 mpirun --oversubscribe -np $n -x TRN_LOG_LEVEL=warn $envs "$BIN/trn-collbench" $(args_of $w) \
            -r avg -f 4 -n "${ITERS:-20}" -w 3 2>/dev/null | collect $tr $n $w
        done
      done
    done
  done
else
  [[ $(id -u) == 0 ]] || { echo "fp8_allreduce.sh: BED needs root (test-bed namespaces)" >&2; exit 2; }
  export TESTBED_OWNER=$$ TRN_NETDELAY=$BIN/trn-netdelay
  for h in $BED; do
    "$TB" up "$name" "$h"
    : >"$out/hosts"
    for ((k = 0; k < h; ++k)); do
      echo "$name-h$k slots=1" >>"$out/hosts"
      [[ ${DELAY:-0} == 0 ]] || "$TB" netem "$name" "$k" "delay ${DELAY}ms"
    done
    for rep in $(seq "$REPS"); do
      for w in f32 bf16 e4m3; do
        "$TB" exec "$name" 0 mpirun --allow-run-as-root --oversubscribe --mca plm_rsh_agent "$ROOT/tests/multihost/trn-rsh" \
          --hostfile "$out/hosts" -np "$h" --map-by slot -x TRN_LOG_LEVEL=warn -x TRN_FABRIC_PROVIDER=tcp \
          "$BIN/trn-collbench" $(args_of $w) -r avg -f 4 -n "${ITERS:-5}" -w 1 2>/dev/null | collect "bed-${DELAY:-0}ms" "$h" $w
      done
    done
    "$TB" down "$name"
  done
fi

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); $REPS launches per side"
/usr/bin/python3 - "$out/rows" <<'PY'
import sys, statistics, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    t, n, w, count, us = line.split()
    d[(t, int(n), int(count), w)].append(float(us))
print("| link | ranks | gradients | f32 (us) | bf16 (us) | e4m3 (us) | bf16 vs f32 | e4m3 vs f32 |")
print("|---|---|---|---|---|---|---|---|")
for t, n, c in sorted({k[:3] for k in d}):
    m = {w: statistics.median(d[(t, n, c, w)]) for w in ("f32", "bf16", "e4m3") if (t, n, c, w) in d}
    if len(m) < 3: continue
    print(f"| {t} | {n} | {c} | {m['f32']:.0f} | {m['bf16']:.0f} | {m['e4m3']:.0f} | "
          f"{m['f32'] / m['bf16']:.2f}x | {m['f32'] / m['e4m3']:.2f}x |")
PY
