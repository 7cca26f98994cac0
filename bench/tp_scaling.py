#!/usr/bin/python3
"""Tensor parallelism against data parallelism and one process, side by side in one run.

For each round, in alternating order: trn-train with 1 process, with 2 processes --dp 2 and
with 2 processes --tp 2 (trnrun), every process on 1 compute thread, all on the same global
batch, so each figure is tokens/s of the same work. Prints the medians over the rounds, the
ratios to one process, and the share of the --tp 2 step spent in tensor-parallel all-reduces.

  /usr/bin/python3 bench/tp_scaling.py --bin build/release/bin [--model small] [--rounds 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile


def run(a, layout, workdir):
    metrics = os.path.join(workdir, f"{layout}.jsonl")
    cmd = [os.path.join(a.bin, "trn-train"), "--model", a.model, "--steps", str(a.steps + a.warmup),
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--threads", "1",
           "--log-every", "1000", "--metrics-jsonl", metrics, "--bucket-mb", str(a.bucket_mb)]
    if layout != "one":
        cmd = [os.path.join(a.bin, "trnrun"), "--nproc-per-node", "2", "--"] + cmd + [f"--{layout}", "2"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{layout} run failed:\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(l) for l in open(metrics)]
    t0, t1 = rows[a.warmup - 1]["elapsed_s"], rows[-1]["elapsed_s"]
    tps = a.steps * a.batch_size * a.seq_len / (t1 - t0)
    m = re.search(r"TP all-reduces took ([0-9.]+)% of the step time", out.stdout + out.stderr)
    return tps, float(m.group(1)) if m else None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True)
    p.add_argument("--model", default="small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    a = p.parse_args()
    res = {k: [] for k in ("one", "dp", "tp")}
    share = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = ["one", "dp", "tp"] if r % 2 == 0 else ["tp", "dp", "one"]
            for k in order:
                tps, s = run(a, k, d)
                res[k].append(tps)
                if s is not None:
                    share.append(s)
                print(f"round {r + 1} {k:4s} {tps:8.0f} tok/s" + (f"  (TP all-reduces {s:.1f}% of the step)" if s is not None else ""), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\nmodel {a.model}, global batch {a.batch_size} x {a.seq_len} tokens, 1 thread per process, "
          f"median of {a.rounds} rounds")
    print("| layout | processes | tok/s | vs one process |")
    print("|---|---|---|---|")
    print(f"| one process | 1 | {med['one']:.0f} | 1.00x |")
    print(f"| --dp 2 | 2 | {med['dp']:.0f} | {med['dp'] / med['one']:.2f}x |")
    print(f"| --tp 2 | 2 | {med['tp']:.0f} | {med['tp'] / med['one']:.2f}x |")
    if share:
        print(f"--tp 2: tensor-parallel all-reduces took {statistics.median(share):.1f}% of the step (median)")


if __name__ == "__main__":
    main()
