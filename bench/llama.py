#!/usr/bin/python3
"""Llama benchmark: trn-train --arch llama vs the PyTorch reference (tests/reference/llama_reference.py
bench) on the same shape, batch and thread count, fp32 and bf16 (trn --precision bf16 against
torch.autocast("cpu", dtype=torch.bfloat16)). In each round every side runs once, trn and PyTorch
alternating (A B A B); tokens/s is the median over rounds, peak RSS the largest. Prints the CPU,
whether it has AVX512-BF16, trn's bf16 kernel path, and one markdown table with trn/PyTorch ratios.
Prints numbers only; asserts nothing. Runs the way bench/bf16.py does for GPT-2.

  /usr/bin/python3 bench/llama.py --bin build/release/bin [--rounds 3] [--threads 1,2] [--precisions fp32,bf16]
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REFERENCE = os.path.join(HERE, "..", "tests", "reference", "llama_reference.py")
sys.path.insert(0, HERE)
from bf16 import cpu_name, run  # noqa: E402

# name: (trn-train model flags, torch flags, batch, seq_len, timed steps, warm-up steps)
CONFIGS = {
    "llama-small": (["--arch", "llama", "--model", "llama-small"], ["--model", "llama-small"], 8, 256, 8, 2),
    "llama-tiny": (["--arch", "llama", "--model", "llama-tiny"], ["--model", "llama-tiny"], 8, 128, 30, 3),
}


def trn(a, cfg, precision, threads):
    flags, _, batch, seq, steps, warm = CONFIGS[cfg]
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        out, rss = run([os.path.join(a.bin, "trn-train")] + flags +
                       ["--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps + warm),
                        "--threads", str(threads), "--precision", precision, "--metrics-jsonl", m,
                        "--log-every", "1000"], {"TRN_LOG_LEVEL": "info"})
        rows = [json.loads(line) for line in open(m)]
        dt = rows[-1]["elapsed_s"] - rows[warm - 1]["elapsed_s"]
        path = re.search(r"bf16 matmul kernels: ([^;(]+)", out)
        return {"tps": steps * batch * seq / dt, "rss": rss, "path": path.group(1).strip() if path else ""}


def torch(a, cfg, precision, threads):
    _, flags, batch, seq, steps, warm = CONFIGS[cfg]
    out, rss = run(["/usr/bin/python3", REFERENCE, "bench"] + flags +
                   ["--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps),
                    "--warmup-bench", str(warm), "--threads", str(threads), "--precision", precision],
                   {"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": "1"})
    return {"tps": float(re.search(r"([0-9.]+) tok/s", out).group(1)), "rss": rss, "path": ""}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default="llama-small")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--precisions", default="fp32,bf16")
    a = p.parse_args()
    feats = open("/proc/cpuinfo").read()
    has = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if re.search(rf"\b{f}\b", feats)]
    rows, path = [], ""
    for cfg in a.configs.split(","):
        for threads in [int(t) for t in a.threads.split(",")]:
            for prec in a.precisions.split(","):
                res = {"trn": [], "torch": []}
                for _ in range(a.rounds):  # alternating: trn, torch, trn, torch, ...
                    for name, f in (("trn", trn), ("torch", torch)):
                        r = f(a, cfg, prec, threads)
                        res[name].append(r)
                        path = r["path"] or path
                rows.append((cfg, threads, prec, {k: (statistics.median(r["tps"] for r in v), max(r["rss"] for r in v))
                                                  for k, v in res.items()}))
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores here; flags: {' '.join(has)}; "
          f"avx512_bf16: {'yes' if 'avx512_bf16' in has else 'no'}); trn bf16 kernel path: {path or 'n/a'}")
    print(f"tokens/s: median of {a.rounds} round(s), trn and PyTorch alternating; peak RSS: the largest; "
          "PyTorch bf16 is torch.autocast bf16")
    print("| config | threads | precision | trn tokens/s | PyTorch tokens/s | trn / PyTorch | trn peak RSS MB | "
          "PyTorch peak RSS MB | trn RSS / PyTorch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cfg, th, prec, r in rows:
        (tt, tr), (pt, pr) = r["trn"], r["torch"]
        print(f"| {cfg} | {th} | {prec} | {tt:.0f} | {pt:.0f} | {tt / pt:.2f}x | {tr:.0f} | {pr:.0f} | {tr / pr:.2f} |")


if __name__ == "__main__":
    main()
