#!/usr/bin/env python3
"""Step time with and without --snapshot-every 1, alternating, on one host.

    bench/snapshot_overhead.py [--build build/release] [--model small] [--steps 30] [--rounds 4]

For each layout (dp 2, and dp 2 x tp 2), runs trn-train under trnrun with snapshots off and on
in turn (A B A B ...), and reports the median over rounds of each run's median step time
(from --metrics-jsonl, the first 5 steps left out), the overhead of snapshots (from those
medians, and the median of each round's own on/off ratio, which a drift of the machine's speed
over the rounds moves less), and the snapshot's own blocked time from the log line "snapshots: N
taken; each blocked the step ...".
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile

BLOCKED = re.compile(r"snapshots: \d+ taken; each blocked the step ([0-9.]+) ms")


def run(args, workdir, layout, snapshots):
    jsonl = os.path.join(workdir, "m.jsonl")
    if os.path.exists(jsonl):
        os.remove(jsonl)
    b = os.path.join(args.build, "bin")
    nproc = 1
    for i in range(0, len(layout), 2):
        nproc *= int(layout[i + 1])
    argv = [os.path.join(b, "trnrun"), "--nproc-per-node", str(nproc), "--", os.path.join(b, "trn-train"), "--model",
            args.model, "--steps", str(args.steps), "--batch-size", "8", "--log-every", "100", "--metrics-jsonl",
            jsonl] + layout + (["--snapshot-every", "1"] if snapshots else [])
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stdout}{out.stderr}")
    elapsed = [json.loads(l)["elapsed_s"] for l in open(jsonl) if '"elapsed_s"' in l]
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])][4:]
    m = BLOCKED.search(out.stdout + out.stderr)
    return statistics.median(steps), float(m.group(1)) if m else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    "build", "release"))
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layouts", default="dp2,dp2tp2", help="dp2, dp2tp2 or both, comma-separated")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="trn-snapshot-overhead-")
    print(f"{os.uname().nodename}: {args.model}, batch 8, {args.steps} steps, {args.rounds} rounds alternating")
    print(f"{'layout':<14} {'off ms/step':>12} {'on ms/step':>11} {'overhead':>9} {'paired':>8} "
          f"{'snapshot blocked ms':>20}")
    layouts = {"dp2": ["--dp", "2"], "dp2tp2": ["--dp", "2", "--tp", "2"]}
    for layout in (layouts[name] for name in args.layouts.split(",")):
        off, on, blocked = [], [], []
        for _ in range(args.rounds):
            off.append(run(args, workdir, layout, False)[0])
            t, b = run(args, workdir, layout, True)
            on.append(t)
            blocked.append(b)
        a, b = statistics.median(off), statistics.median(on)
        paired = statistics.median(y / x - 1 for x, y in zip(off, on))
        print(f"{' '.join(layout):<14} {a * 1e3:12.1f} {b * 1e3:11.1f} {(b - a) / a:9.1%} {paired:8.1%} "
              f"{statistics.median(blocked):20.2f}", flush=True)


if __name__ == "__main__":
    main()
