#!/usr/bin/python3
"""Benchmark: trn-train vs the PyTorch reference (gpt2_reference.py bench), same model, same
batch, same thread count, alternating A B A B in one run; medians. Prints tokens/s, peak RSS and
model FLOPs utilization against cblas_sgemm on one core (trn-sgemm-probe, measured in the same
run). Prints numbers only; asserts nothing.

  /usr/bin/python3 tests/reference/benchmark.py --bin build/release/bin [--rounds 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = {"tiny": (2, 128, 128, 256), "small": (4, 256, 256, 256)}  # n_layer, d, ctx, vocab


def flops_per_token(model):
    L, C, T, V = PRESETS[model]
    return 6.0 * (L * 12 * C * C + V * C) + 12.0 * L * T * C


def run(cmd, env=None):
    """Runs cmd; returns (stdout, peak RSS in MB)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **(env or {})))
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out}")
    return out, usage.ru_maxrss / 1024


def trn(args, model, threads, steps, warm):
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        _, rss = run([os.path.join(args.bin, "trn-train"), "--model", model, "--batch-size",
                      str(args.batch), "--steps", str(steps + warm), "--threads", str(threads),
                      "--metrics-jsonl", m, "--log-every", "1000"], {"TRN_LOG_LEVEL": "warn"})
        rows = [json.loads(l) for l in open(m)][warm:]
        prev = [json.loads(l) for l in open(m)][warm - 1]["elapsed_s"]
        dt = rows[-1]["elapsed_s"] - prev
        return len(rows) * args.batch * PRESETS[model][2] / dt, rss


def torch(args, model, threads, blas, steps, warm):
    out, rss = run(["/usr/bin/python3", os.path.join(HERE, "gpt2_reference.py"), "bench",
                    "--model", model, "--batch-size", str(args.batch), "--seq-len",
                    str(PRESETS[model][2]), "--steps", str(steps), "--warmup-bench", str(warm),
                    "--threads", str(threads)],
                   {"OPENBLAS_NUM_THREADS": str(blas), "OMP_NUM_THREADS": str(threads)})
    return float(re.search(r"([0-9.]+) tok/s", out).group(1)), rss


def sgemm(args):
    out, _ = run([os.path.join(args.bin, "trn-sgemm-probe"), "--threads", "1"])
    return float(re.search(r"peak ([0-9.]+) GFLOP/s", out).group(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--models", default="tiny,small")
    a = p.parse_args()
    peaks = []
    rows = []
    for model in a.models.split(","):
        steps, warm = (30, 3) if model == "tiny" else (8, 2)
        sides = {
            "trn 1 thread": lambda: trn(a, model, 1, steps, warm),
            "torch 1 thread": lambda: torch(a, model, 1, 1, steps, warm),
            "trn 2 threads": lambda: trn(a, model, 2, steps, warm),
            "torch 2 threads": lambda: torch(a, model, 2, 2, steps, warm),
            "torch 1 thread + OPENBLAS_NUM_THREADS=2": lambda: torch(a, model, 1, 2, steps, warm),
        }
        res = {k: [] for k in sides}
        for _ in range(a.rounds):
            peaks.append(sgemm(a))
            for k, f in sides.items():
                res[k].append(f())
        for k, v in res.items():
            rows.append((model, k, statistics.median(x[0] for x in v), max(x[1] for x in v),
                         flops_per_token(model)))
    peak = statistics.median(peaks)
    print(f"cblas_sgemm, 1 thread: {peak:.1f} GFLOP/s (median of {len(peaks)})")
    print(f"batch {a.batch} sequences x ctx; medians of {a.rounds} alternating rounds")
    print("| model | side | tokens/s | GFLOP/s | MFU (1-core sgemm) | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for model, k, tps, rss, fpt in rows:
        g = tps * fpt / 1e9
        print(f"| {model} | {k} | {tps:.0f} | {g:.1f} | {100 * g / peak:.0f}% | {rss:.0f} |")
    for model in a.models.split(","):
        r = {k: t for m, k, t, _, _ in rows if m == model}
        best2 = max(r["torch 2 threads"], r["torch 1 thread + OPENBLAS_NUM_THREADS=2"])
        print(f"{model}: trn/torch at 1 thread {r['trn 1 thread'] / r['torch 1 thread']:.2f}x, "
              f"trn 2 threads / torch best 2-core {r['trn 2 threads'] / best2:.2f}x")


if __name__ == "__main__":
    main()
