#!/usr/bin/python3
"""--precision bf16 benchmark: trn-train bf16 vs trn fp32, PyTorch fp32 and PyTorch bf16
(torch.autocast("cpu", dtype=torch.bfloat16)), same model, batch and thread count, the four sides
alternating within each round. Prints one markdown table: tokens/s (median over rounds),
activation memory as trn-train reports it, and peak RSS, with the CPU and the bf16 kernel path.
Prints numbers only; asserts nothing.

  /usr/bin/python3 bench/bf16.py --bin build/release/bin [--rounds 1] [--configs tiny,small,gpt2-2l]
  /usr/bin/python3 bench/bf16.py --bin build/release/bin --configs small --trn-only --rounds 5
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
REFERENCE = os.path.join(HERE, "..", "tests", "reference", "gpt2_reference.py")

# name: (trn-train model flags, torch flags, batch, seq_len, timed steps, warm-up steps)
CONFIGS = {
    "tiny": (["--model", "tiny"], ["--model", "tiny"], 8, 128, 30, 3),
    "small": (["--model", "small"], ["--model", "small"], 8, 256, 8, 2),
    # GPT-2's width, vocabulary and heads with 2 blocks, short sequences so a step fits here
    "gpt2-2l": (["--model", "gpt2", "--n-layer", "2"], ["--model", "gpt2", "--n-layer", "2"], 2, 128, 4, 1),
}


def run(cmd, env=None):
    """Runs cmd; returns (output, peak RSS in MB)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **(env or {})))
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out}")
    return out, usage.ru_maxrss / 1024


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
        act = float(re.search(r"([0-9.]+) MB activations", out).group(1))
        path = re.search(r"bf16 matmul kernels: ([^;(]+)", out)
        return {"tps": steps * batch * seq / dt, "rss": rss, "act": act, "path": path.group(1).strip() if path else ""}


def torch(a, cfg, precision, threads):
    _, flags, batch, seq, steps, warm = CONFIGS[cfg]
    out, rss = run(["/usr/bin/python3", REFERENCE, "bench"] + flags +
                   ["--batch-size", str(batch), "--seq-len", str(seq), "--steps", str(steps),
                    "--warmup-bench", str(warm), "--threads", str(threads), "--precision", precision],
                   {"OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": "1"})
    return {"tps": float(re.search(r"([0-9.]+) tok/s", out).group(1)), "rss": rss, "act": None, "path": ""}


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--configs", default="tiny,small,gpt2-2l")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--trn-only", action="store_true", help="only trn fp32 and trn bf16 (for more rounds)")
    a = p.parse_args()
    sides = [("trn fp32", trn, "fp32"), ("trn bf16", trn, "bf16"), ("torch fp32", torch, "fp32"),
             ("torch bf16 autocast", torch, "bf16")]
    if a.trn_only:
        sides = sides[:2]
    table, path = [], ""
    for cfg in a.configs.split(","):
        for threads in [int(t) for t in a.threads.split(",")]:
            res = {name: [] for name, _, _ in sides}
            for _ in range(a.rounds):
                for name, f, prec in sides:  # alternating: every round runs each side once
                    r = f(a, cfg, prec, threads)
                    res[name].append(r)
                    path = r["path"] or path
            for name, _, _ in sides:
                rs = res[name]
                table.append((cfg, threads, name, statistics.median(r["tps"] for r in rs),
                              rs[0]["act"], max(r["rss"] for r in rs)))
    feats = open("/proc/cpuinfo").read()
    has = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16") if re.search(rf"\b{f}\b", feats)]
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores here; flags: {' '.join(has)}); "
          f"trn bf16 kernel path: {path}")
    print(f"tokens/s: median of {a.rounds} round(s), the four sides alternating in each")
    print("| config | threads | side | tokens/s | vs trn fp32 | trn activations MB | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    base = {}
    for cfg, th, name, tps, act, rss in table:
        if name == "trn fp32":
            base[(cfg, th)] = tps
        rel = tps / base[(cfg, th)]
        print(f"| {cfg} | {th} | {name} | {tps:.0f} | {rel:.2f}x | {'' if act is None else f'{act:.1f}'} | {rss:.0f} |")


if __name__ == "__main__":
    main()
