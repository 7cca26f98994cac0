#!/usr/bin/python3
"""--precision bf16 benchmark: trn-train bf16 vs trn fp32, PyTorch fp32 and PyTorch bf16
(torch.autocast("cpu", dtype=torch.bfloat16)), same model, batch and thread count, the four sides
alternating within each round. Prints one markdown table: tokens/s (median over rounds),
activation memory as trn-train reports it, and peak RSS, with the CPU and the bf16 kernel path.
Then a second table: 2 data-parallel workers under trnrun with --zero 0/1 and --grad-comm
f32/fp8, alternating, with tokens/s, AdamW state and peak RSS per rank. Prints numbers only;
asserts nothing.

  /usr/bin/python3 bench/bf16.py --bin build/release/bin [--rounds 1] [--configs tiny,small,gpt2-2l]
  /usr/bin/python3 bench/bf16.py --bin build/release/bin --configs small --trn-only --rounds 5
  /usr/bin/python3 bench/bf16.py --bin build/release/bin --configs none --dp-configs gpt2-2l,small
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


# name: (trn-train flags with the global batch, timed steps, warm-up steps) for the dp 2 table
DP_CONFIGS = {
    "small": (["--model", "small", "--batch-size", "8", "--seq-len", "256"], 8, 2),
    # where AdamW's state (8 bytes per parameter, 46M parameters) is most of a rank's memory
    "gpt2-2l": (["--model", "gpt2", "--n-layer", "2", "--batch-size", "4", "--seq-len", "128"], 4, 1),
}


def trn_dp(a, cfg, zero, wire):
    flags, steps, warm = DP_CONFIGS[cfg]
    with tempfile.TemporaryDirectory() as d:
        m = os.path.join(d, "m.jsonl")
        out, _ = run([os.path.join(a.bin, "trnrun"), "--nproc-per-node", "2", "--",
                      os.path.join(a.bin, "trn-train")] + flags +
                     ["--dp", "2", "--zero", str(zero), "--grad-comm", wire, "--bucket-mb", "4",
                      "--steps", str(steps + warm), "--metrics-jsonl", m, "--log-every", "1000"],
                     {"TRN_LOG_LEVEL": "info"})
        rows = [json.loads(line) for line in open(m)]
        batch = int(flags[flags.index("--batch-size") + 1]) * int(flags[flags.index("--seq-len") + 1])
        dt = rows[-1]["elapsed_s"] - rows[warm - 1]["elapsed_s"]
        rss = [float(x) for x in re.findall(r"\] [^\n]*peak RSS ([0-9.]+) MB", out)]
        state = [int(x) for x in re.findall(r"optimizer state: ([0-9]+) bytes on this rank", out)]
        return {"tps": steps * batch / dt, "rss": max(rss), "state": max(state)}


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
    p.add_argument("--dp-configs", default="gpt2-2l", help="models of the dp 2 table (none: skip it)")
    a = p.parse_args()
    if a.configs == "none":
        a.configs = ""
    sides = [("trn fp32", trn, "fp32"), ("trn bf16", trn, "bf16"), ("torch fp32", torch, "fp32"),
             ("torch bf16 autocast", torch, "bf16")]
    if a.trn_only:
        sides = sides[:2]
    table, path = [], ""
    for cfg in filter(None, a.configs.split(",")):
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
    base = {}
    if table:
        print(f"tokens/s: median of {a.rounds} round(s), the four sides alternating in each")
        print("| config | threads | side | tokens/s | vs trn fp32 | trn activations MB | peak RSS MB |")
        print("|---|---|---|---|---|---|---|")
    for cfg, th, name, tps, act, rss in table:
        if name == "trn fp32":
            base[(cfg, th)] = tps
        rel = tps / base[(cfg, th)]
        print(f"| {cfg} | {th} | {name} | {tps:.0f} | {rel:.2f}x | {'' if act is None else f'{act:.1f}'} | {rss:.0f} |")

    dp = [c for c in a.dp_configs.split(",") if c and c != "none"]
    if not dp:
        return
    sides = [(0, "f32"), (1, "f32"), (0, "fp8"), (1, "fp8")]
    print()
    print(f"dp 2 under trnrun (1 thread per rank, 4 MiB buckets): tokens/s of the job, median of {a.rounds} "
          "round(s), sides alternating; AdamW state and peak RSS: the larger of the 2 ranks")
    print("| config | --zero | --grad-comm | tokens/s | AdamW state per rank MB | peak RSS per rank MB |")
    print("|---|---|---|---|---|---|")
    for cfg in dp:
        res = {side: [] for side in sides}
        for _ in range(a.rounds):
            for zero, wire in sides:
                res[(zero, wire)].append(trn_dp(a, cfg, zero, wire))
        for zero, wire in sides:
            rs = res[(zero, wire)]
            print(f"| {cfg} | {zero} | {wire} | {statistics.median(r['tps'] for r in rs):.0f} | "
                  f"{rs[0]['state'] / 1e6:.1f} | {max(r['rss'] for r in rs):.0f} |")


if __name__ == "__main__":
    main()
