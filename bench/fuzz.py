#!/usr/bin/env python3
"""Runs trn's fuzz targets (tests/fuzz/, built by the asan preset) and counts what they ran.

  bench/fuzz.py --seconds 600 [--targets checkpoint,safetensors] [--jobs 2] [--out FILE.md]

Each target fuzzes for --seconds from its checked-in seeds and regressions plus a corpus it keeps
between runs in build/asan/fuzz/<target>/corpus (the same folder `ctest -L fuzz` grows). Prints,
and with --out appends to a markdown file, one row per target: executions, executions per second,
corpus size, and whether it found anything (crash, leak, timeout or out-of-memory inputs land in
build/asan/fuzz/<target>/artifacts/). Exits 1 when a target found something.
"""
import os
import sys

# bench/tokenize.py would shadow the standard library's tokenize module (imported by logging).
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import datetime  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def targets(bin_dir):
    return sorted(n[len("fuzz_"):] for n in os.listdir(bin_dir) if n.startswith("fuzz_"))


def run(build, name, seconds):
    work = os.path.join(build, "fuzz", name)
    corpus, artifacts = os.path.join(work, "corpus"), os.path.join(work, "artifacts")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    before = set(os.listdir(artifacts))
    dirs = [corpus] + [d for d in (os.path.join(ROOT, "tests", "fuzz", "corpus", name),
                                   os.path.join(ROOT, "tests", "fuzz", "regressions", name)) if os.path.isdir(d)]
    cmd = [os.path.join(build, "bin", "fuzz_" + name), f"-max_total_time={seconds}", "-timeout=10",
           "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={artifacts}/"] + dirs
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               ASAN_SYMBOLIZER_PATH="/usr/lib/llvm-14/bin/llvm-symbolizer")
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env)
    stats = dict(re.findall(r"stat::(\w+):\s+(\d+)", p.stderr))
    found = sorted(set(os.listdir(artifacts)) - before)
    if p.returncode != 0 and not found:
        found = [f"exit {p.returncode}"]
    tail = "\n".join(p.stderr.splitlines()[-30:]) if found else ""
    return {"target": name, "execs": int(stats.get("number_of_executed_units", 0)),
            "per_s": int(stats.get("average_exec_per_sec", 0)), "corpus": len(os.listdir(corpus)),
            "found": found, "tail": tail}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "asan"))
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--targets", default="", help="comma-separated (default: every fuzz_* in the build)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="append the table to this markdown file")
    a = ap.parse_args()
    names = a.targets.split(",") if a.targets else targets(os.path.join(a.build, "bin"))
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda n: run(a.build, n, a.seconds), names))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Run ended {stamp}: `bench/fuzz.py --seconds {a.seconds} --jobs {a.jobs}"
             + (f" --targets {a.targets}`" if a.targets else "`"), "",
             "| target | executions | exec/s | corpus | found |", "|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['execs']:,} | {r['per_s']:,} | {r['corpus']} | "
                     f"{', '.join(r['found']) or 'nothing'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    for r in rows:
        if r["tail"]:
            print(f"--- {r['target']}:\n{r['tail']}\n", file=sys.stderr)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + text)
    return 1 if any(r["found"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
