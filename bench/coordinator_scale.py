#!/usr/bin/env python3
"""The coordinator at 10,000 to 100,000 simulated ranks, node heartbeats once a second.

Each shape runs with node heartbeats as UDP datagrams (trnrun's default) and as gRPC calls (the
fallback), alternating. Runs trn-coordbench against a trn-coordinator this script starts (so the coordinator outlives
the bench), for each shape in turn, round after round (the shapes alternate, so host noise
spreads over all of them), and after each 100,000-rank run times `trnctl status JOB` (the
summary a user sees) and `trnctl status JOB --json` (every rank, paged) against the job the
bench left. Prints one line per run and the medians per shape.

  /usr/bin/python3 bench/coordinator_scale.py [--rounds 3] [--seconds 15] [--build build/release]
      [--transports datagram,grpc] [--shapes 10000x8,50000x16,100000x16,100000x32] [--tokens]

--tokens: the coordinator requires tokens (a fresh admin token): joins and gRPC calls carry it,
datagrams carry the job token's MAC, as a secured deployment runs.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = [(10000, 8), (50000, 16), (100000, 16), (100000, 32)]


def run_once(build, workers, per_node, seconds, transport, tokens):
    bindir = os.path.join(build, "bin")
    with tempfile.TemporaryDirectory() as d:
        port_file = os.path.join(d, "port")
        auth = []
        if tokens:
            with open(os.path.join(d, "token"), "w") as f:
                f.write(os.urandom(32).hex() + "\n")
            auth = ["--token-file", os.path.join(d, "token")]
        coord = subprocess.Popen([os.path.join(bindir, "trn-coordinator"), "--listen", "127.0.0.1:0",
                                  "--port-file", port_file] + auth, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                if os.path.exists(port_file) and open(port_file).read().strip():
                    break
                time.sleep(0.05)
            address = "127.0.0.1:" + open(port_file).read().strip()
            out = subprocess.run([os.path.join(bindir, "trn-coordbench"), "--workers", str(workers),
                                  "--ranks-per-node", str(per_node), "--seconds", str(seconds),
                                  "--transport", transport,
                                  "--coordinator", address, "--coordinator-pid", str(coord.pid)] + auth,
                                 capture_output=True, text=True, timeout=600).stdout
            r = {"workers": workers, "per_node": per_node, "transport": transport}
            m = re.search(r"lost \(unanswered within 2 s\) ([0-9]+)|errors ([0-9]+)", out)
            r["lost"] = int(m.group(1) or m.group(2))
            m = re.search(r"p50 ([0-9.]+)\s+p90 ([0-9.]+)\s+p99 ([0-9.]+)", out)
            r["p50"], r["p90"], r["p99"] = map(float, m.groups())
            m = re.search(r"heartbeat phase ([0-9.]+) s \(([0-9.]+)% of one core\)", out)
            r["cpu_s"], r["cpu_pct"] = float(m.group(1)), float(m.group(2))
            m = re.search(r"heard from: ([0-9]+) of ([0-9]+)", out)
            r["heard"] = int(m.group(1))
            m = re.search(r"bench process cpu ([0-9.]+) s", out)
            r["bench_cpu_s"] = float(m.group(1))
            m = re.search(r"all joined: \w+ in ([0-9.]+) s", out)
            r["join_s"] = float(m.group(1))
            if workers == 100000:
                job = re.search(r"job (coordbench-[0-9]+)", out)
                job = job.group(1) if job else None
                if job is None:
                    jobs = subprocess.run([os.path.join(bindir, "trnctl"), "--coordinator", address] + auth
                                          + ["status"],
                                          capture_output=True, text=True).stdout
                    job = re.search(r"^job (\S+)", jobs, re.M).group(1)
                for key, extra in (("status_s", []), ("status_json_s", ["--json"])):
                    t = time.monotonic()
                    p = subprocess.run([os.path.join(bindir, "trnctl"), "--coordinator", address] + auth
                                       + ["status", job] + extra, capture_output=True, text=True)
                    r[key] = time.monotonic() - t
                    if key == "status_s":
                        r["status_lines"] = p.stdout.count("\n")
            return r
        finally:
            coord.send_signal(signal.SIGTERM)
            coord.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--build", default="build/release")
    ap.add_argument("--transports", default="datagram,grpc")
    ap.add_argument("--shapes", default=",".join(f"{w}x{k}" for w, k in SHAPES))
    ap.add_argument("--tokens", action="store_true")
    a = ap.parse_args()
    transports = a.transports.split(",")
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    runs = []
    for k in range(a.rounds):
        for workers, per_node in shapes:
            for transport in transports:
                r = run_once(a.build, workers, per_node, a.seconds, transport, a.tokens)
                runs.append(r)
                print(f"round {k + 1}: {transport}: {workers} ranks as {workers // per_node} x {per_node}: "
                      f"p50 {r['p50']:.2f} ms "
                      f"p99 {r['p99']:.2f} ms, coordinator {r['cpu_pct']:.1f}% of a core ({r['cpu_s']:.2f} s), "
                      f"bench {r['bench_cpu_s']:.2f} s, heard {r['heard']}, lost or failed {r['lost']}, "
                      f"joined in {r['join_s']:.2f} s"
                      + (f", trnctl status {r['status_s']:.3f} s ({r['status_lines']} lines), --json "
                         f"{r['status_json_s']:.3f} s" if "status_s" in r else ""), flush=True)
    print("\nmedians:")
    print("| ranks (nodes x ranks per node) | heartbeats as | heartbeat p50 | p99 | coordinator CPU | bench CPU |"
          " ranks heard | lost or failed | trnctl status | --json (every rank) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (workers, per_node), transport in ((s, t) for s in shapes for t in transports):
        rs = [r for r in runs if r["workers"] == workers and r["per_node"] == per_node and r["transport"] == transport]
        med = lambda key: statistics.median(r[key] for r in rs)
        status = f"{med('status_s'):.3f} s" if "status_s" in rs[0] else "-"
        status_json = f"{med('status_json_s'):.3f} s" if "status_json_s" in rs[0] else "-"
        print(f"| {workers:,} ({workers // per_node:,} x {per_node}) | {transport} | {med('p50'):.2f} ms | "
              f"{med('p99'):.1f} ms | {med('cpu_pct'):.0f}% of a core | "
              f"{med('bench_cpu_s') / a.seconds * 100:.0f}% of a core | "
              f"{min(r['heard'] for r in rs):,} of {workers:,} | {max(r['lost'] for r in rs)} | {status} | "
              f"{status_json} |")


if __name__ == "__main__":
    sys.exit(main())
