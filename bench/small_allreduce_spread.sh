#!/bin/bash
# Launch-to-launch spread of small all-reduces on one host: trn-collbench (2 ranks by default,
# shm) against --mpi-anchor (Open MPI, vader), and any number of trn variants that differ by
# environment, launcher or launcher flags, launches alternating round-robin.
#   bench/small_allreduce_spread.sh [BIN_DIR]
#   REPS=8 RANKS=2 ARGS="-b 16K -e 256K -f 4 -n 50 -w 5" \
#     VARIANTS="trn| mpi|--mpi-anchor nopoll|-x,TRN_COLL_POLL_US=0" bench/small_allreduce_spread.sh
#   VARIANTS="trnrun|@trnrun unbound|@trnrun,--bind,none mpi|--mpi-anchor" bench/small_allreduce_spread.sh
#   VARIANTS="before|@trnrun,@bin=/tmp/old/bin after|@trnrun mpi|--mpi-anchor" bench/small_allreduce_spread.sh
#   TRANSPORT=tcp ... (trn: TRN_FABRIC_PROVIDER=tcp TRN_FABRIC_SHM=0; Open MPI: its tcp BTL)
# VARIANTS: space-separated NAME|FLAGS (commas for spaces inside a variant's flags). A variant
# runs under mpirun, or under trnrun when its flags hold @trnrun (a FileStore in a fresh
# directory bootstraps the fabric); @cpus=LIST runs the launcher under taskset -c LIST; @bin=DIR
# takes trnrun and trn-collbench from DIR instead of BIN_DIR (two builds in one run). Launcher
# flags (-x NAME=VALUE, --bind-to, --map-by, --mca for mpirun; --bind for trnrun, -x for its
# environment) go to the launcher, the rest to trn-collbench. Each launch's rows go to RAW (if
# set); printed per variant and size: every launch's mean (us), the median launch's mean, the
# largest launch mean over the median, and the medians of the launches' p50 and p99.
set -euo pipefail
BIN=$(cd "${1:-build/release/bin}" && pwd)
REPS=${REPS:-8}
RANKS=${RANKS:-2}
ARGS=${ARGS:--b 16K -e 256K -f 4 -n 50 -w 5}
VARIANTS=${VARIANTS:-trn| mpi|--mpi-anchor}
out=$(mktemp -d)
trap '[[ -z ${RAW:-} ]] || cp "$out/rows" "$RAW"; rm -rf "$out"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [[ ${TRANSPORT:-shm} == tcp ]]; then
  btl=self,tcp trn_env=(TRN_FABRIC_PROVIDER=tcp TRN_FABRIC_SHM=0)
else
  btl=self,vader trn_env=(TRN_FABRIC_PROVIDER=shm)
fi

run() {  # name flags rep
  local name=$1 flags=${2//,/ } rep=$3 pre=() post=() env=("${trn_env[@]}" TRN_LOG_LEVEL=warn) launcher=mpirun wrap=()
  local bin=$BIN
  read -r -a all <<<"$flags"
  for ((i = 0; i < ${#all[@]}; ++i)); do
    case ${all[i]} in
      @trnrun) launcher=trnrun ;;
      @cpus=*) wrap=(taskset -c "${all[i]#@cpus=}") ;;
      @bin=*) bin=$(cd "${all[i]#@bin=}" && pwd) ;;
      -x) env+=("${all[i + 1]}"); ((++i)) ;;
      --bind-to | --map-by | --mca | --bind) pre+=("${all[i]}" "${all[i + 1]}"); ((++i)) ;;
      *) post+=("${all[i]}") ;;
    esac
  done
  if [[ $launcher == trnrun ]]; then
    local store
    store=$(mktemp -d)
    # shellcheck disable=SC2086
    env "${env[@]}" TRN_STORE_DIR="$store" timeout 600 "${wrap[@]}" "$bin/trnrun" --nproc-per-node "$RANKS" "${pre[@]}" -- \
      "$bin/trn-collbench" $ARGS "${post[@]}" 2>/dev/null | sed 's/^\[rank 0\] //' >"$out/launch" ||
      echo "# $name launch $rep failed" >&2
    rm -rf "$store"
  else
    local x=()
    for e in "${env[@]}"; do x+=(-x "$e"); done
    # shellcheck disable=SC2086
    timeout 600 "${wrap[@]}" mpirun --oversubscribe -np "$RANKS" --mca btl "$btl" "${x[@]}" "${pre[@]}" "$bin/trn-collbench" \
      $ARGS "${post[@]}" 2>/dev/null >"$out/launch" || echo "# $name launch $rep failed" >&2
  fi
  awk -v v="$name" -v r="$rep" '/^  / { print v, r, $1, $6, $10, $11 }' "$out/launch" >>"$out/rows"
}

read -r -a variants <<<"$VARIANTS"
for ((rep = 0; rep < REPS; ++rep)); do
  k=${#variants[@]}
  for ((j = 0; j < k; ++j)); do
    v=${variants[(j + rep) % k]}
    run "${v%%|*}" "${v#*|}" "$rep"
  done
done

echo "# $(uname -n), $(nproc) cores, load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $RANKS ranks, ${TRANSPORT:-shm}, $ARGS, $REPS launches per variant"
/usr/bin/python3 - "$out/rows" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
order = []
for line in open(sys.argv[1]):
    v, rep, size, us, p50, p99 = line.split()
    if v not in order:
        order.append(v)
    runs[(v, int(size))].append((float(us), float(p50), float(p99)))
print("| variant | size | launch means (us) | median launch | worst / median | p50 (median) | p99 (median) |")
print("|---|---|---|---|---|---|---|")
for size in sorted({k[1] for k in runs}):
    for v in order:
        xs = runs.get((v, size))
        if not xs:
            continue
        means = sorted(x[0] for x in xs)
        med = statistics.median(means)
        print(f"| {v} | {size >> 10} KiB | {', '.join(f'{m:.1f}' for m in means)} | {med:.1f} | "
              f"{max(means) / med:.2f} | {statistics.median(x[1] for x in xs):.1f} | "
              f"{statistics.median(x[2] for x in xs):.1f} |")
PY
