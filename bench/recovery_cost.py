#!/usr/bin/env python3
"""What three kill -9s cost a data-parallel job on one host, recovering in place.

    bench/recovery_cost.py [--build build/release] [--model small] [--steps 120] [--rounds 3]

Each round runs, alternating, a clean job (trnrun, trn-train --dp 2, no snapshots) and the same
job with trnrun --recovery in-place and --snapshot-every 1 (no --checkpoint-dir), killing a
worker with SIGKILL at 25%, 50% and 75% of the clean run's wall time (ranks 1, 0, 1). It prints
each pair's wall times and their difference (the cost of the three failures, snapshots
included), whether the survivors kept their pids, the recoveries' figures from the
--metrics-jsonl, and whether the final weights equal the clean run's byte for byte.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time


def worker_pids(trnrun_pid):
    """rank -> pid of the trn-train children of trnrun_pid."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) != trnrun_pid or fields[0] == "Z":
                continue
            if b"trn-train" not in open(f"/proc/{name}/cmdline", "rb").read():
                continue
            for e in open(f"/proc/{name}/environ", "rb").read().split(b"\0"):
                if e.startswith(b"TRN_RANK="):
                    out[int(e[9:])] = int(name)
        except OSError:
            continue
    return out


def run(args, workdir, tag, kills_at=()):
    save = os.path.join(workdir, f"{tag}.safetensors")
    jsonl = os.path.join(workdir, f"{tag}.jsonl")
    for p in (save, jsonl):
        if os.path.exists(p):
            os.remove(p)
    b = os.path.join(args.build, "bin")
    argv = [os.path.join(b, "trnrun"), "--nproc-per-node", "2"]
    train = [os.path.join(b, "trn-train"), "--model", args.model, "--steps", str(args.steps), "--batch-size", "8",
             "--dp", "2", "--log-every", "10", "--save", save, "--metrics-jsonl", jsonl]
    if kills_at:
        argv += ["--recovery", "in-place", "--max-restarts", str(len(kills_at))]
        train += ["--snapshot-every", "1"]
    log = open(os.path.join(workdir, f"{tag}.log"), "w")
    t0 = time.time()
    p = subprocess.Popen(argv + ["--"] + train, stdout=log, stderr=subprocess.STDOUT)
    kept = []
    for i, at in enumerate(kills_at):
        while time.time() - t0 < at and p.poll() is None:
            time.sleep(0.01)
        pids = worker_pids(p.pid)
        while len(pids) < 2 and p.poll() is None:  # a replacement still starting
            time.sleep(0.01)
            pids = worker_pids(p.pid)
        victim = 1 if i % 2 == 0 else 0
        os.kill(pids[victim], signal.SIGKILL)
        # The survivor's pid, checked once the next recovery line is written.
        kept.append((1 - victim, pids[1 - victim]))
        while p.poll() is None:
            lines = [l for l in open(jsonl).read().splitlines() if '"recovery"' in l] if os.path.exists(jsonl) else []
            if len(lines) > i:
                break
            time.sleep(0.02)
        kept[-1] = kept[-1][1] == worker_pids(p.pid).get(kept[-1][0])
    code = p.wait()
    wall = time.time() - t0
    recoveries = []
    if os.path.exists(jsonl):
        for line in open(jsonl):
            if '"recovery"' in line:
                recoveries.append(json.loads(line))
    return {"wall": wall, "code": code, "kept": kept, "recoveries": recoveries,
            "weights": open(save, "rb").read() if os.path.exists(save) else b""}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "build", "release"))
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="trn-recovery-cost-")
    print(f"{os.uname().nodename}: {args.model}, dp 2 on one host, {args.steps} steps of batch 8, "
          f"3 kill -9s per faulted run (ranks 1, 0, 1 at 25/50/75% of the clean run's time)")
    print(f"{'round':>5} {'clean s':>8} {'3 kills s':>9} {'cost s':>7} {'survivors kept pid':>18} "
          f"{'first step after kill s':>24} {'steps lost':>10} {'weights':>9}")
    costs = []
    for r in range(args.rounds):
        clean = run(args, workdir, "clean")
        faulted = run(args, workdir, "faulted", [clean["wall"] * f for f in (0.25, 0.5, 0.75)])
        cost = faulted["wall"] - clean["wall"]
        costs.append(cost)
        firsts = " ".join(f"{x['first_step_s']:.2f}" for x in faulted["recoveries"])
        lost = sum(x["steps_lost"] for x in faulted["recoveries"])
        same = "identical" if faulted["weights"] and faulted["weights"] == clean["weights"] else "DIFFER"
        print(f"{r + 1:5d} {clean['wall']:8.1f} {faulted['wall']:9.1f} {cost:7.1f} "
              f"{'yes' if all(faulted['kept']) and len(faulted['kept']) == 3 else 'NO':>18} {firsts:>24} "
              f"{lost:10d} {same:>9}")
        if clean["code"] or faulted["code"]:
            print(f"      exit codes: clean {clean['code']}, faulted {faulted['code']} (logs in {workdir})")
    print(f"median cost of three kills: {statistics.median(costs):.1f} s")


if __name__ == "__main__":
    main()
