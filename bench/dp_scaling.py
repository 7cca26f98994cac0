#!/usr/bin/python3
"""Data-parallel scaling of trn-train against PyTorch DDP (gloo), side by side in one run.

For each round, in alternating order: trn with 1 worker, trn with 2 workers (trnrun, --dp 2),
PyTorch with 1 process, PyTorch DDP with 2 processes (gloo). Every worker runs 1 compute thread
and the same per-worker batch, so perfect scaling doubles tokens/s. Prints the medians over the
rounds, the 2-vs-1 ratios and the fraction of all-reduce time trn hid behind backward.

  /usr/bin/python3 bench/dp_scaling.py --bin build/release/bin [--model small] [--rounds 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def trn(a, workers, workdir):
    metrics = os.path.join(workdir, f"trn{workers}.jsonl")
    cmd = [os.path.join(a.bin, "trn-train"), "--model", a.model, "--steps", str(a.steps + a.warmup),
           "--batch-size", str(a.per_worker_batch * workers), "--seq-len", str(a.seq_len),
           "--threads", "1", "--log-every", "1000", "--metrics-jsonl", metrics,
           "--bucket-mb", str(a.bucket_mb)]
    if workers > 1:
        cmd = [os.path.join(a.bin, "trnrun"), "--nproc-per-node", str(workers), "--"] + cmd + ["--dp", str(workers)]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"trn run failed:\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(l) for l in open(metrics)]
    t0 = rows[a.warmup - 1]["elapsed_s"]
    t1 = rows[-1]["elapsed_s"]
    tps = a.steps * a.per_worker_batch * workers * a.seq_len / (t1 - t0)
    hidden = None
    m = re.search(r"(\d+)% of gradients were all-reduced before backward ended", out.stdout + out.stderr)
    if m:
        hidden = int(m.group(1))
    return tps, hidden


def torch_run(a, workers):
    cmd = ["/usr/bin/python3", os.path.join(HERE, "ddp_reference.py"), "--model", a.model, "--workers", str(workers),
           "--per-worker-batch", str(a.per_worker_batch), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
           "--warmup", str(a.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"torch run failed:\n{out.stdout}\n{out.stderr}")
    return float(re.search(r"([0-9.]+) tok/s", out.stdout).group(1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", required=True)
    p.add_argument("--model", default="small")
    p.add_argument("--per-worker-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    a = p.parse_args()
    res = {k: [] for k in ("trn1", "trn2", "torch1", "torch2")}
    hidden = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(a.rounds):
            order = ["trn1", "trn2", "torch1", "torch2"] if r % 2 == 0 else ["torch2", "torch1", "trn2", "trn1"]
            for k in order:
                if k.startswith("trn"):
                    tps, h = trn(a, int(k[-1]), d)
                    if h is not None:
                        hidden.append(h)
                else:
                    tps = torch_run(a, int(k[-1]))
                res[k].append(tps)
                print(f"round {r + 1} {k:7s} {tps:8.0f} tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"\nmodel {a.model}, {a.per_worker_batch} x {a.seq_len} tokens per worker, 1 thread per worker, "
          f"median of {a.rounds} rounds")
    print(f"| | 1 worker tok/s | 2 workers tok/s | 2 vs 1 |")
    print(f"|---|---|---|---|")
    print(f"| trn (trnrun, --dp 2) | {med['trn1']:.0f} | {med['trn2']:.0f} | {med['trn2'] / med['trn1']:.2f}x |")
    print(f"| PyTorch DDP (gloo) | {med['torch1']:.0f} | {med['torch2']:.0f} | {med['torch2'] / med['torch1']:.2f}x |")
    print(f"trn 2 workers vs PyTorch DDP 2 processes: {med['trn2'] / med['torch2']:.2f}x")
    if hidden:
        print(f"gradients all-reduced before backward ended (trn 2 workers, median): {statistics.median(hidden):.0f}%")


if __name__ == "__main__":
    main()
