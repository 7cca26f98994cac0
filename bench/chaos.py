#!/usr/bin/env python3
"""Chaos benchmark: recovery in place against restart-all, on the multi-host test bed.

    sudo bench/chaos.py [--build build/release] [--steps auto] [--interval 20]

A bed of 5 hosts (tests/multihost/testbed.sh): the coordinator in host 0, one trnrun of 2 ranks
in each of hosts 1..4, training tiny at dp 2 x tp 2 x pp 2 (each host one tensor-parallel pair).
Three runs of the same job, in one invocation:

  fault-free   no faults: the reference weights and wall time;
  in-place     trnrun --recovery in-place, trn-train --snapshot-every 1;
  restart-all  trnrun --recovery restart, trn-train --checkpoint-dir --checkpoint-every K
               (today's path: every worker restarts and resumes from the newest checkpoint).

Both faulted runs get the same schedule, one fault every --interval seconds of their run: kill -9
of a random worker, except that the second fault SIGSTOPs a worker (the coordinator's heartbeat
timeout declares it dead) and the fourth kills a whole host, whose trnrun is started again once
the others saw the loss. For each fault the script reports the time from the fault to the first
step completed after it (from the workers' timestamped progress lines), the steps lost (the
newest step completed before the fault minus the step training went on from), and for the run
its wall time, goodput relative to the fault-free run (its wall time over this run's), and
whether the final weights equal the fault-free run's byte for byte.
"""
import argparse
import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTBED = os.path.join(ROOT, "tests", "multihost", "testbed.sh")
STEP = re.compile(r"\[rank 0\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) info \[\S+ r0 g(\d+) train\] step (\d+)/(\d+) \|")
# The agents' line for a generation that ended (either recovery).
ENDED = re.compile(r"moved on|restarting the workers|recovering in place")
RESTORED = re.compile(r"restored step (\d+) from memory")
RESUMED = re.compile(r"resumed from \S+ at step (\d+)")


def sh(*args, **kw):
    return subprocess.run(list(args), check=True, **kw)


def stamp(text):
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


class Bed:
    def __init__(self, name, hosts):
        self.name = name
        sh(TESTBED, "sweep")
        sh(TESTBED, "up", name, str(hosts), env=dict(os.environ, TESTBED_OWNER=str(os.getpid())))

    def addr(self, k):
        return subprocess.run([TESTBED, "addr", self.name, str(k)], check=True, capture_output=True,
                              text=True).stdout.strip()

    def popen(self, k, argv, log, env=None):
        return subprocess.Popen([TESTBED, "exec", self.name, str(k)] + argv, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})), start_new_session=True)

    def kill(self, k):
        sh(TESTBED, "kill", self.name, str(k))

    def down(self):
        subprocess.run([TESTBED, "down", self.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def worker_pids(job):
    """rank -> pid of the job's live trn-train workers."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if b"trn-train" not in open(f"/proc/{name}/cmdline", "rb").read():
                continue
            env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
            stat = open(f"/proc/{name}/stat").read()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] == "Z" or f"TRN_JOB_ID={job}".encode() not in env:
            continue
        for e in env:
            if e.startswith(b"TRN_RANK="):
                out[int(e[9:])] = int(name)
    return out


class Run:
    def __init__(self, args, bed, coordinator, mode, workdir, steps):
        self.args, self.bed, self.mode, self.dir = args, bed, mode, workdir
        self.job = f"chaos-{mode}"
        self.save = os.path.join(workdir, f"{mode}.safetensors")
        train = [os.path.join(args.build, "bin", "trn-train"), "--model", "tiny", "--n-head", "8", "--steps",
                 str(steps), "--batch-size", "16", "--seq-len", "128", "--log-every", "1", "--lr", "1e-4",
                 "--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2", "--save", self.save]
        recovery = "restart"
        if mode == "in-place":
            train += ["--snapshot-every", "1"]
            recovery = "in-place"
        elif mode == "restart-all":
            ckpt = os.path.join(workdir, "ckpt")
            os.makedirs(ckpt, exist_ok=True)
            train += ["--checkpoint-dir", ckpt, "--checkpoint-every", str(args.checkpoint_every)]
        self.argv = lambda k: [os.path.join(args.build, "bin", "trnrun"), "--coordinator", coordinator, "--job-id",
                               self.job, "--nnodes", "4", "--nproc-per-node", "2", "--node-rank", str(k),
                               "--recovery", recovery, "--max-restarts", "20", "--"] + train
        self.logs, self.procs = {}, {}

    def start(self, k):
        path = os.path.join(self.dir, f"{self.mode}-h{k + 1}-{len(self.logs)}.log")
        self.logs[len(self.logs)] = path
        self.procs[k] = self.bed.popen(k + 1, self.argv(k), open(path, "w"),
                                       env={"TRN_HEARTBEAT_INTERVAL": str(self.args.heartbeat_interval)})

    def output(self):
        return "".join(open(p, errors="replace").read() for p in self.logs.values())

    @staticmethod
    def steps_of(output):
        return sorted((stamp(m.group(1)), int(m.group(2)), int(m.group(3))) for m in STEP.finditer(output))

    def steps_done(self):
        """[(unix time, generation, step)] of rank 0's progress lines, in order."""
        return Run.steps_of(self.output())

    def running(self):
        return any(p.poll() is None for p in self.procs.values())


def execute(args, bed, coordinator, mode, workdir, steps, faults):
    run = Run(args, bed, coordinator, mode, workdir, steps)
    t0 = time.time()
    for k in range(4):
        run.start(k)
    rng = random.Random(args.seed)
    log = []
    next_fault = t0 + args.interval
    while run.running():
        time.sleep(0.05)
        if faults == 0 or time.time() < next_fault:
            continue
        pids = worker_pids(run.job)
        if len(pids) < 8:
            continue  # recovering from the last fault: wait for every worker
        n = len(log)
        kind = {1: "sigstop", 3: "host"}.get(n, "kill")
        rank = rng.randrange(8)
        when = time.time()
        if kind == "kill":
            os.kill(pids[rank], signal.SIGKILL)
        elif kind == "sigstop":
            os.kill(pids[rank], signal.SIGSTOP)
        else:
            host = rank // 2
            ended = len(ENDED.findall(run.output()))
            bed.kill(host + 1)
            run.procs[host].wait()
            # Its replacement comes once the others saw the loss (a running job whose members all
            # look alive refuses a new node).
            while len(ENDED.findall(run.output())) == ended and time.time() < when + 60:
                time.sleep(0.05)
            run.start(host)
        log.append({"kind": kind, "rank": rank, "at": when})
        faults -= 1
        next_fault = time.time() + args.interval
    wall = time.time() - t0
    codes = [p.wait() for p in run.procs.values()]
    out = run.output()
    progress = run.steps_done()
    went_on = [int(m.group(1)) for m in (RESTORED if mode == "in-place" else RESUMED).finditer(out)]
    for f in log:
        # The newest step done before the fault; the first step done in a later generation (the
        # recovered job's) and whether it repeats steps done before (lost).
        done = [(g, s) for t, g, s in progress if t <= f["at"]]
        gen, before = done[-1] if done else (0, 0)
        before = max((s for _, s in done), default=0)
        later = [(t, s) for t, g, s in progress if t > f["at"] and g > gen]
        f["before"] = before
        f["recovery_s"] = later[0][0] - f["at"] if later else float("nan")
        f["lost"] = max(0, before - (later[0][1] - 1)) if later else -1
    identical = os.path.exists(run.save) and open(run.save, "rb").read()
    return {"mode": mode, "wall": wall, "codes": codes, "faults": log, "weights": identical, "went_on": went_on,
            "output": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--steps", default="auto", help="steps per run (auto: about 8 faults' worth, at least 300)")
    ap.add_argument("--interval", type=float, default=20.0, help="seconds between faults")
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--heartbeat-timeout", type=float, default=4.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--keep", action="store_true", help="keep the logs (their folder is printed)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("chaos.py: needs root (network namespaces)")
    bed = Bed(f"ch{os.getpid() % 100000}", 5)
    workdir = tempfile.mkdtemp(prefix="trn-chaos-")
    coord_log = open(os.path.join(workdir, "coordinator.log"), "w")
    port_file = os.path.join(workdir, "port")
    coordinator = bed.popen(0, [os.path.join(args.build, "bin", "trn-coordinator"), "--listen", bed.addr(0) + ":0",
                                "--port-file", port_file, "--heartbeat-timeout", str(args.heartbeat_timeout)],
                            coord_log)
    try:
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            time.sleep(0.05)
        address = bed.addr(0) + ":" + open(port_file).read().strip().split(":")[-1]
        steps = args.steps
        if steps == "auto":
            probe = execute(args, bed, address, "probe", workdir, 60, 0)
            prog = [t for t, _, _ in Run.steps_of(probe["output"])]
            per_step = (prog[-1] - prog[9]) / (len(prog) - 10)
            steps = max(300, int(args.interval * (args.faults + 2) / per_step))
            print(f"probe: {per_step * 1e3:.1f} ms per step: {steps} steps per run")
        steps = int(steps)
        results = [execute(args, bed, address, m, workdir, steps, f)
                   for m, f in (("fault-free", 0), ("in-place", args.faults), ("restart-all", args.faults))]
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait()
        bed.down()
    ref = results[0]
    print(f"\n{os.uname().nodename}: {steps} steps of tiny (8 heads) at dp 2 x tp 2 x pp 2, 4 hosts x 2 ranks, "
          f"batch 16 x 128; a fault every {args.interval:.0f} s; heartbeat timeout {args.heartbeat_timeout} s")
    print(f"{'run':<12} {'wall s':>8} {'goodput':>8} {'faults':>6} {'median recovery s':>18} "
          f"{'max recovery s':>15} {'steps lost':>10} {'max lost/fault':>14} {'weights':>9} exit")
    for r in results:
        rec = [f["recovery_s"] for f in r["faults"]]
        lost = [f["lost"] for f in r["faults"]]
        same = "identical" if r["weights"] and r["weights"] == ref["weights"] else "DIFFER"
        print(f"{r['mode']:<12} {r['wall']:8.1f} {ref['wall'] / r['wall']:8.1%} {len(r['faults']):6d} "
              f"{statistics.median(rec) if rec else 0:18.2f} {max(rec) if rec else 0:15.2f} {sum(lost):10d} "
              f"{max(lost) if lost else 0:14d} {same:>9} {','.join(map(str, r['codes']))}")
    for r in results[1:]:
        print(f"\n{r['mode']} faults:")
        for f in r["faults"]:
            print(f"  {f['kind']:<8} rank {f['rank']} after step {f['before']:4d}: next step {f['recovery_s']:.2f} s "
                  f"later, {f['lost']} step(s) lost")
    if args.keep:
        print(f"\nlogs in {workdir}")
    else:
        subprocess.run(["rm", "-rf", workdir])


if __name__ == "__main__":
    main()
