#!/usr/bin/python3
"""Latency of a /metrics scrape (curl) while idle sockets sit on the coordinator's metrics port.

  bench/metrics_idle_sockets.py [--idle 0,40,200] [--runs 5] BIN_DIR [BIN_DIR ...]

For each BIN_DIR (its trn-coordinator) and each idle count: starts trn-coordinator with
--metrics-listen on a free loopback port, opens that many TCP connections that never send a
byte (one the server closes is reopened at once, from a thread of its own), waits 1 s, then
runs `curl --max-time 15` on /metrics --runs times, 1 s apart, and prints the median and the
worst time_total as a Markdown table row (a timed-out scrape counts as its 15 s and is marked).
"""
import argparse
import os
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

CURL_MAX = 15


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(port):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    return s


class Idle:
    def __init__(self, port, n):
        self.port, self.reopened, self.stop = port, 0, False
        self.sel = selectors.DefaultSelector()
        for _ in range(n):
            self.sel.register(connect(port), selectors.EVENT_READ)
        self.thread = threading.Thread(target=self.hold, daemon=True)
        self.thread.start()

    def hold(self):
        while not self.stop:
            for key, _ in self.sel.select(timeout=0.05):
                s = key.fileobj
                try:
                    if s.recv(1):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self.sel.unregister(s)
                s.close()
                self.sel.register(connect(self.port), selectors.EVENT_READ)
                self.reopened += 1

    def close(self):
        self.stop = True
        self.thread.join()
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def scrape(port):
    r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", "--max-time",
                        str(CURL_MAX), f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True)
    code, t = r.stdout.split()
    return float(t) if code == "200" else None


def measure(bindir, idle, runs):
    with tempfile.TemporaryDirectory() as d:
        mport = free_port()
        coord = subprocess.Popen([os.path.join(bindir, "trn-coordinator"), "--listen", "127.0.0.1:0",
                                  "--port-file", f"{d}/port", "--metrics-listen", f"127.0.0.1:{mport}"],
                                 stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 20
            while not (os.path.exists(f"{d}/port") and open(f"{d}/port").read().strip()):
                if time.monotonic() > end or coord.poll() is not None:
                    sys.exit(f"{bindir}/trn-coordinator did not start")
                time.sleep(0.05)
            holder = Idle(mport, idle) if idle else None
            time.sleep(1)
            times = []
            for _ in range(runs):
                times.append(scrape(mport))
                time.sleep(1)
            if holder:
                holder.close()
        finally:
            coord.terminate()
            coord.wait(10)
    failed = sum(t is None for t in times)
    vals = [CURL_MAX if t is None else t for t in times]
    return statistics.median(vals), max(vals), failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", default="0,40,200")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("bindirs", nargs="+")
    a = ap.parse_args()
    print(f"| trn-coordinator | idle sockets | median scrape s ({a.runs} runs) | worst s | failed (curl {CURL_MAX} s timeout) |")
    print("|---|---|---|---|---|")
    for b in a.bindirs:
        for n in [int(x) for x in a.idle.split(",")]:
            med, worst, failed = measure(b, n, a.runs)
            print(f"| {b} | {n} | {med:.4f} | {worst:.4f} | {failed} |", flush=True)


if __name__ == "__main__":
    main()
