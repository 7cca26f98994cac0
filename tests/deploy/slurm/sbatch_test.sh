#!/usr/bin/env bash
# Runs deploy/slurm/trn.sbatch on a real one-machine Slurm cluster: writes its own munge key and
# slurm.conf into a temp dir, starts munged, slurmctld and slurmd (proctrack/linuxproc,
# task/none, no cgroups), submits the script with `sbatch --wait`, and checks that the job
# completed with exit 0 and that both workers trained. Everything it started is stopped and the
# temp dir removed on any exit.
#   sbatch_test.sh SOURCE_DIR BIN_DIR
set -euo pipefail
src=$1 bin=$2
fail() {
  echo "sbatch_test: FAIL: $*" >&2
  for f in "${tmp:-/nonexistent}"/log/*; do [ -f "$f" ] && { echo "---- $f" >&2; tail -n 20 "$f" >&2; }; done
  exit 1
}
for t in munged slurmctld slurmd sbatch scontrol sinfo; do
  command -v "$t" >/dev/null || fail "$t is not installed (deploy/install-deps.sh installs slurm-wlm and munge)"
done

tmp=$(mktemp -d /tmp/trn-slurm-XXXXXX)
chmod 700 "$tmp"
pids=()
cleanup() {
  set +e
  if [ -f "$tmp/slurm.conf" ]; then
    SLURM_CONF=$tmp/slurm.conf timeout 10 scancel --full --quiet --user="$(id -un)" 2>/dev/null
    sleep 1
  fi
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill -TERM "${pids[i]}" 2>/dev/null; done
  for _ in $(seq 50); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  # slurmstepd outlives slurmd; it and the job's processes live in the job's own process groups.
  for p in $(pgrep -f "slurmstepd.*$tmp" 2>/dev/null) $(pgrep -f -- "$tmp/work" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
  if [ "${keep:-0}" = 1 ]; then echo "sbatch_test: logs kept in $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local secs=$1 what=$2; shift 2
  for _ in $(seq $((secs * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "$what within $secs s"
}

mkdir -p "$tmp"/{munge,ctld,spool,log,work}
head -c 1024 /dev/urandom > "$tmp/munge/munge.key"
chmod 400 "$tmp/munge/munge.key"
munged --force --foreground --key-file="$tmp/munge/munge.key" --socket="$tmp/munge/socket" \
  --pid-file="$tmp/munge/munged.pid" --seed-file="$tmp/munge/seed" --log-file="$tmp/log/munged.log" 2>>"$tmp/log/munged.stderr" &
pids+=($!)
wait_for 10 "munged did not create its socket" test -S "$tmp/munge/socket"

node=trnnode
cat > "$tmp/slurm.conf" <<CONF
ClusterName=trntest
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$tmp/munge/socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$tmp/ctld
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$(hostname -s) CPUs=$(nproc) RealMemory=1024 State=UNKNOWN
PartitionName=trn Nodes=$node Default=YES MaxTime=10 State=UP
CONF
export SLURM_CONF=$tmp/slurm.conf

slurmctld -D -i -f "$SLURM_CONF" 2>>"$tmp/log/slurmctld.stderr" &
pids+=($!)
wait_for 20 "slurmctld did not answer" scontrol ping
slurmd -D -f "$SLURM_CONF" -N "$node" 2>>"$tmp/log/slurmd.stderr" &
pids+=($!)
idle() { sinfo -h -n "$node" -o %T | grep -qx idle; }
wait_for 30 "node $node did not become idle" idle

# The script gives the other nodes its hostname; where that does not resolve, loopback.
export_host=""
getent hosts "$(hostname)" >/dev/null || export_host=",TRN_COORDINATOR_HOST=127.0.0.1"

# 20 steps of GPT tiny on 2 data-parallel workers, one node.
set +e
(cd "$tmp/work" && timeout 180 sbatch --wait --nodes=1 --ntasks-per-node=1 --time=5 \
  --output="$tmp/work/job.out" --export="ALL,TRN_BIN=$bin,TRN_NPROC_PER_NODE=2$export_host" \
  "$src/deploy/slurm/trn.sbatch" --model tiny --steps 20 --log-every 5) > "$tmp/sbatch.out" 2>&1
rc=$?
set -e
cat "$tmp/sbatch.out"
echo "---- job output"
cat "$tmp/work/job.out" 2>/dev/null || true
echo "----"
job=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$tmp/sbatch.out")
[ -n "$job" ] || { keep=1; fail "sbatch did not submit the job (exit $rc)"; }
state=$(scontrol show job "$job" | tr ' ' '\n' | sed -n 's/^JobState=//p')
exitcode=$(scontrol show job "$job" | tr ' ' '\n' | sed -n 's/^ExitCode=//p')
echo "sbatch_test: job $job: sbatch exit $rc, JobState=$state ExitCode=$exitcode"
[ "$rc" = 0 ] && [ "$state" = COMPLETED ] && [ "$exitcode" = 0:0 ] || fail "job $job did not complete with exit 0"
grep -q "trn.sbatch: job slurm-$job, coordinator " "$tmp/work/job.out" || fail "the script did not report its coordinator"
for r in 0 1; do
  grep -q "^\[rank $r\]" "$tmp/work/job.out" || fail "rank $r printed nothing"
done
grep -q "step 20/20 | loss " "$tmp/work/job.out" || fail "no loss line of step 20"
grep -q "final weights identical on all 2 data-parallel replicas" "$tmp/work/job.out" || fail "the replicas did not finish in agreement"
echo "sbatch_test: ok"
