#!/usr/bin/env python3
"""Runs trn's fuzz targets (tests/fuzz/, built by the asan preset) and counts what they ran.

  bench/fuzz.py --seconds 600 [--targets checkpoint,safetensors] [--jobs 2] [--out FILE.md]
  bench/fuzz.py --campaign --seconds 900 --budget 7200 --jobs 1 --out FILE.md

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
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def targets(bin_dir):
    return sorted(n[len("fuzz_"):] for n in os.listdir(bin_dir) if n.startswith("fuzz_"))


GOAL_EXECS = 10_000_000
GOAL_SECONDS = 3600


def run(build, name, seconds):
    work = os.path.join(build, "fuzz", name)
    corpus, artifacts = os.path.join(work, "corpus"), os.path.join(work, "artifacts")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(artifacts, exist_ok=True)
    before = set(os.listdir(artifacts))
    dirs = [corpus] + [d for d in (os.path.join(ROOT, "tests", "fuzz", "corpus", name),
                                   os.path.join(ROOT, "tests", "fuzz", "regressions", name)) if os.path.isdir(d)]
    # -timeout is wall-clock: 30 s keeps a target that shares its core with a build from being
    # reported as hung, and still stops on a real hang.
    cmd = [os.path.join(build, "bin", "fuzz_" + name), f"-max_total_time={seconds}", "-timeout=30",
           "-rss_limit_mb=2048", "-print_final_stats=1", f"-artifact_prefix={artifacts}/"] + dirs
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               ASAN_SYMBOLIZER_PATH="/usr/lib/llvm-14/bin/llvm-symbolizer")
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        started = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        log.seek(0)
        stderr = log.read()
    stats = dict(re.findall(r"stat::(\w+):\s+(\d+)", stderr))
    found = sorted(set(os.listdir(artifacts)) - before)
    if p.returncode != 0 and not found:
        found = [f"exit {p.returncode}"]
    tail = "\n".join(stderr.splitlines()[-30:]) if found else ""
    return {"target": name, "execs": int(stats.get("number_of_executed_units", 0)),
            "per_s": int(stats.get("average_exec_per_sec", 0)), "seconds": round(wall),
            "cpu": round(usage.ru_utime + usage.ru_stime), "corpus": len(os.listdir(corpus)),
            "found": found, "tail": tail}


def table(rows):
    lines = ["| target | executions | exec/s | seconds | CPU s | corpus | found |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['target']} | {r['execs']:,} | {r['per_s']:,} | {r['seconds']} | {r['cpu']} | "
                     f"{r['corpus']} | {', '.join(r['found']) or 'nothing'} |")
    return lines


def number(cell):
    cell = cell.strip().replace(",", "")
    return int(cell) if cell.isdigit() else None


def totals(path):
    """Sums every run table in a results file: {target: [executions, seconds]}. A row's seconds
    are its own column when it has one, else executions / exec/s (libFuzzer's elapsed time), else
    zero."""
    sums, header = {}, None
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if not cells:
            header = None
        elif cells[0] == "target":
            header = cells
        elif header and "executions" in header and "exec/s" in header and not cells[0].startswith("---"):
            row = dict(zip(header, cells))
            execs, per_s, secs = number(row["executions"]), number(row["exec/s"]), number(row.get("seconds", ""))
            if secs is None:
                secs = execs / per_s if execs and per_s else 0
            s = sums.setdefault(row["target"], [0, 0.0])
            s[0] += execs or 0
            s[1] += secs
    return sums


def met(execs, secs):
    return execs >= GOAL_EXECS or secs >= GOAL_SECONDS


def write_totals(path):
    """Replaces the body of the file's "## Totals" section with the sums of its run tables."""
    sums = totals(path)
    lines = ["| target | executions | fuzzing time | goal (10M executions or 1 h) |", "|---|---:|---:|---|"]
    for name in sorted(sums):
        execs, secs = sums[name]
        lines.append(f"| {name} | {execs:,} | {secs / 60:.0f} min | {'met' if met(execs, secs) else 'not yet'} |")
    text = open(path).read()
    if "## Totals\n" not in text:  # a file of runs only: the section goes at its end
        text += "\n## Totals\n"
    head, rest = text.split("## Totals\n", 1)
    # The section's body ends where the next section or the next run's table begins (a campaign
    # appends its runs after the Totals of a file that has no later section).
    ends = [i for i in (rest.find("\n## "), rest.find("\nRun ended ")) if i >= 0]
    tail = rest[min(ends):] if ends else ""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = f"\nAs of {stamp}, every run below:\n\n" + "\n".join(lines) + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(head + "## Totals\n" + body + tail)
    os.replace(tmp, path)
    return sums


def campaign(a):
    """Runs the targets short of the goal, each for at most --seconds per round, appending every
    round to --out, until all meet it or --budget seconds have passed."""
    deadline = time.monotonic() + a.budget
    found_any = False
    broken = set()  # targets a run of this campaign stopped on: fixed before they run again
    while time.monotonic() < deadline:
        sums = write_totals(a.out)
        wanted = a.targets.split(",") if a.targets else targets(os.path.join(a.build, "bin"))
        short = []
        for name in wanted:
            if name in broken:
                continue
            execs, secs = sums.get(name, [0, 0.0])
            if met(execs, secs):
                continue
            rate = execs / secs if secs else 0
            need = GOAL_SECONDS - secs
            if rate:
                need = min(need, (GOAL_EXECS - execs) / rate)
            short.append((name, max(30, min(a.seconds, int(need) + 5))))
        if not short:
            break
        left = deadline - time.monotonic()
        short = [(n, min(s, int(left))) for n, s in short if left >= 30]
        if not short:
            break
        # Each target's row is appended as soon as it ends, so an interrupted campaign loses at
        # most the runs still going.
        with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
            runs = [pool.submit(run, a.build, name, secs) for name, secs in short]
            for done in concurrent.futures.as_completed(runs):
                if done.result()["found"]:
                    broken.add(done.result()["target"])
                found_any |= report([done.result()], f"`bench/fuzz.py --campaign --seconds {a.seconds} --jobs {a.jobs}`",
                                    a.out)
                write_totals(a.out)
    write_totals(a.out)
    return 1 if found_any else 0


def report(rows, command, out):
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([f"Run ended {stamp}: {command}", ""] + table(rows)) + "\n"
    print(text, flush=True)
    for r in rows:
        if r["tail"]:
            print(f"--- {r['target']}:\n{r['tail']}\n", file=sys.stderr)
    if out:
        with open(out, "a") as f:
            f.write("\n" + text)
    return any(r["found"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "asan"))
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--targets", default="", help="comma-separated (default: every fuzz_* in the build)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="append the table to this markdown file")
    ap.add_argument("--totals", action="store_true", help="only recompute the Totals section of --out")
    ap.add_argument("--campaign", action="store_true",
                    help="run the targets short of 10M executions or 1 h (per --out) until they meet it")
    ap.add_argument("--budget", type=int, default=3600, help="--campaign stops after this many seconds")
    a = ap.parse_args()
    if (a.totals or a.campaign) and not a.out:
        ap.error("--totals and --campaign need --out")
    if a.totals and not os.path.isfile(a.out):
        ap.error(f"--out {a.out}: no such results file to total")
    if a.campaign and not os.path.exists(a.out):
        open(a.out, "w").close()
    if a.totals:
        write_totals(a.out)
        return 0
    if a.campaign:
        return campaign(a)
    names = a.targets.split(",") if a.targets else targets(os.path.join(a.build, "bin"))
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda n: run(a.build, n, a.seconds), names))
    command = f"`bench/fuzz.py --seconds {a.seconds} --jobs {a.jobs}" + (f" --targets {a.targets}`" if a.targets else "`")
    found = report(rows, command, a.out)
    if a.out:
        write_totals(a.out)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
