#!/bin/bash
# trn all-reduce vs Open MPI MPI_Allreduce (f32 sum), side by side: for shm (Open MPI btl
# self,vader) and tcp (btl tcp,self), 2 and 4 ranks, REPS alternating launches of each; prints
# the medians as a markdown table. Both sides block on each call before issuing the next
# (trn-collbench -z 1), as MPI_Allreduce does, on the same buffers, which start OFFSET bytes past
# a page boundary (default 64, as a 64-byte-aligned tensor allocator places them; 16 is
# malloc's). Usage: bench_vs_openmpi.sh [BIN_DIR]   (env REPS, ITERS, OUT, OFFSET)
BIN=${1:-build/release/bin}/trn-collbench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
REPS=${REPS:-5}
OUT=${OUT:-$(mktemp)}
: > $OUT
for tr in shm tcp; do
  for n in 2 4; do
    for rep in $(seq $REPS); do
      if [ $tr = shm ]; then envs="-x TRN_FABRIC_PROVIDER=shm"; btl="self,vader"; else envs="-x TRN_FABRIC_PROVIDER=tcp -x TRN_FABRIC_SHM=0"; btl="tcp,self"; fi
      timeout 300 mpirun --oversubscribe -np $n -x TRN_LOG_LEVEL=warn $envs $BIN -z 1 -b 4K -e 16M -f 4 -n ${ITERS:-200} -w 10 --offset ${OFFSET:-64} 2>/dev/null | grep -v '^#' | awk -v t=$tr -v n=$n '{print t, n, "trn", $1, $5, $6, $8}' >> $OUT
      timeout 300 mpirun --oversubscribe -np $n --mca btl $btl $BIN --mpi-anchor -z 1 -b 4K -e 16M -f 4 -n ${ITERS:-200} -w 10 --offset ${OFFSET:-64} 2>/dev/null | grep -v '^#' | awk -v t=$tr -v n=$n '{print t, n, "mpi", $1, $5, $6, $8}' >> $OUT
    done
  done
done
python3 - $OUT <<'PY'
import sys, statistics, collections
d = collections.defaultdict(list); algo = {}
for line in open(sys.argv[1]):
    t, n, who, size, a, us, bus = line.split()
    d[(t, int(n), int(size), who)].append((float(us), float(bus)))
    if who == 'trn': algo[(t, int(n), int(size))] = a
print("| transport | ranks | size | trn algo | trn time (us) | trn busbw (GB/s) | Open MPI time (us) | Open MPI busbw (GB/s) | trn/MPI busbw |")
print("|---|---|---|---|---|---|---|---|---|")
for key in sorted({k[:3] for k in d}):
    t, n, size = key
    tr = d.get(key + ('trn',), []); mp = d.get(key + ('mpi',), [])
    if not tr or not mp: continue
    tus = statistics.median(x[0] for x in tr); tb = statistics.median(x[1] for x in tr)
    mus = statistics.median(x[0] for x in mp); mb = statistics.median(x[1] for x in mp)
    print(f"| {t} | {n} | {size} | {algo[key]} | {tus:.1f} | {tb:.3f} | {mus:.1f} | {mb:.3f} | {tb/mb if mb else 0:.2f}x |")
PY
