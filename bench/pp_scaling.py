#!/usr/bin/python3
"""Pipeline parallelism against data and tensor parallelism, and each schedule's bubble.

Part 1, alternating rounds on the same global batch, every process on 1 compute thread:
trn-train with 1 process, --dp 2, --tp 2 and --pp 2 (1F1B, 8 micro-batches); tokens/s and the
largest peak RSS of any rank (medians over rounds).
Part 2: each stage's measured bubble (the share of its step it waited for a neighbour) against
the theory, for P = 2 and 4, M = 4, 8 and 16, under 1f1b, zb and (P = 2) interleaved with 2
chunks per rank.

  /usr/bin/python3 bench/pp_scaling.py --bin build/release/bin [--rounds 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def run(a, workdir, procs, extra, batch, steps):
    metrics = os.path.join(workdir, "m.jsonl")
    cmd = [os.path.join(a.bin, "trn-train"), "--model", a.model, "--steps", str(steps + a.warmup),
           "--batch-size", str(batch), "--seq-len", str(a.seq_len), "--threads", "1", "--log-every", "1000",
           "--metrics-jsonl", metrics, "--bucket-mb", "2"] + extra
    if procs > 1:
        cmd = [os.path.join(a.bin, "trnrun"), "--nproc-per-node", str(procs), "--"] + cmd
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"run failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(l) for l in open(metrics)]
    steps_rows = [r for r in rows if "step" in r]
    t0, t1 = steps_rows[a.warmup - 1]["elapsed_s"], steps_rows[-1]["elapsed_s"]
    tps = steps * batch * a.seq_len / (t1 - t0)
    rss = max(float(x) for x in re.findall(r"peak RSS ([0-9.]+) MB", out.stdout + out.stderr))
    bubble = next((r for r in rows if "bubble" in r), None)
    return tps, rss, bubble


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    layouts = {"one process": (1, []), "--dp 2": (2, ["--dp", "2"]), "--tp 2": (2, ["--tp", "2"]),
               "--pp 2 (1f1b, M 8)": (2, ["--pp", "2", "--micro-batches", "8"])}
    res = {k: [] for k in layouts}
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
            for k in order:
                procs, extra = layouts[k]
                tps, rss, _ = run(a, d, procs, extra, a.batch_size, a.steps)
                res[k].append((tps, rss))
                print(f"round {r + 1} {k:20s} {tps:8.0f} tok/s  peak RSS {rss:.0f} MB", flush=True)
        one = statistics.median(t for t, _ in res["one process"])
        print(f"\nmodel {a.model}, global batch {a.batch_size} x {a.seq_len}, 1 thread per process, median of {a.rounds} rounds")
        print("| layout | processes | tok/s | vs one process | peak RSS per rank (MB) |")
        print("|---|---|---|---|---|")
        for k, (procs, _) in layouts.items():
            t = statistics.median(x for x, _ in res[k])
            m = statistics.median(x for _, x in res[k])
            print(f"| {k} | {procs} | {t:.0f} | {t / one:.2f}x | {m:.0f} |")
        print("\n| P | M | schedule | tok/s | measured bubble per stage | theory |")
        print("|---|---|---|---|---|---|")
        for P in (2, 4):
            for M in (4, 8, 16):
                scheds = [("1f1b", []), ("zb", [])]
                if P == 2:
                    scheds.append(("interleaved", ["--virtual-stages", "2"]))
                for name, extra in scheds:
                    batch = max(a.batch_size, M)
                    tps, _, b = run(a, d, P, ["--pp", str(P), "--micro-batches", str(M), "--schedule", name] + extra,
                                    batch, a.steps)
                    stages = " ".join(f"{100 * x:.1f}%" for x in b["bubble"])
                    print(f"| {P} | {M} | {name} | {tps:.0f} | {stages} | {100 * b['bubble_theory']:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
