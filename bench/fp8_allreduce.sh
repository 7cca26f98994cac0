#!/bin/bash
# The data-parallel gradient all-reduce with each wire format: f32, bf16 (-d bf16) and e4m3
# (--wire e4m3), the same number of f32 gradients each, over shm and tcp, 2 and 4 ranks under
# mpirun, REPS launches of each side alternating; prints the median time per all-reduce (us) as a
# markdown table, with each format's speed-up over f32. Operations are issued back to back and
# the last awaited, as the trainer's buckets are.
#   bench/fp8_allreduce.sh [BIN_DIR]     (env REPS (5), ITERS (20), MIN (256K), MAX (16M) elements)
BIN=${1:-build/release/bin}/trn-collbench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
REPS=${REPS:-5}
MIN=${MIN:-256K}; MAX=${MAX:-16M}
num() { numfmt --from=iec "$1"; }
OUT=$(mktemp)
for tr in shm tcp; do
  if [ $tr = shm ]; then envs="-x TRN_FABRIC_PROVIDER=shm"; else envs="-x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_SHM=0"; fi
  for n in 2 4; do
    for rep in $(seq $REPS); do
      for w in f32 bf16 e4m3; do
        case $w in
          f32) args="-d f32 -b $(( $(num $MIN) * 4 )) -e $(( $(num $MAX) * 4 ))" ;;
          bf16) args="-d bf16 -b $(( $(num $MIN) * 2 )) -e $(( $(num $MAX) * 2 ))" ;;
          e4m3) args="-d f32 --wire e4m3 -b $(( $(num $MIN) * 4 )) -e $(( $(num $MAX) * 4 ))" ;;
        esac
        timeout 600 mpirun --oversubscribe -np $n -x TRN_LOG_LEVEL=warn $envs $BIN $args -r avg -f 4 \
          -n ${ITERS:-20} -w 3 2>/dev/null | grep -v '^#' | awk -v t=$tr -v n=$n -v w=$w '{print t, n, w, $2, $6}' >> $OUT
      done
    done
  done
done
python3 - $OUT <<'PY'
import sys, statistics, collections
d = collections.defaultdict(list)
for line in open(sys.argv[1]):
    t, n, w, count, us = line.split()
    d[(t, int(n), int(count), w)].append(float(us))
print("| transport | ranks | gradients | f32 (us) | bf16 (us) | e4m3 (us) | bf16 vs f32 | e4m3 vs f32 |")
print("|---|---|---|---|---|---|---|---|")
for t, n, c in sorted({k[:3] for k in d}):
    m = {w: statistics.median(d[(t, n, c, w)]) for w in ("f32", "bf16", "e4m3") if (t, n, c, w) in d}
    if len(m) < 3: continue
    print(f"| {t} | {n} | {c} | {m['f32']:.0f} | {m['bf16']:.0f} | {m['e4m3']:.0f} | "
          f"{m['f32'] / m['bf16']:.2f}x | {m['f32'] / m['e4m3']:.2f}x |")
PY
rm -f $OUT
