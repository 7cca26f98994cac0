"""Anchor for trn-coordbench (not a test): the same load on PyTorch's TCPStore, the store under
torchrun's c10d rendezvous. A TCPStore server runs in its own process; N clients (one connection
each) "join" (add to a counter, then wait for the last one's key) and then each writes a
heartbeat key every interval. Prints the same lines as trn-coordbench.

    /usr/bin/python3 tests/integration/coordinator/tcpstore_anchor.py [workers] [seconds]
"""
import datetime
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import torch.distributed as dist


def serve(port_q, stop_ev):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=120), False)
    port_q.put((port, os.getpid()))
    stop_ev.wait()
    del store


def cpu_and_rss(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = hwm = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return cpu, rss, hwm


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))] if v else 0.0


def main():
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 30
    q, stop = mp.Queue(), mp.Event()
    server = mp.Process(target=serve, args=(q, stop))
    server.start()
    port, pid = q.get(timeout=60)
    base = cpu_and_rss(pid)[0]
    stores = []
    t0 = time.monotonic()
    joined = []

    def join(lo, hi):
        for i in range(lo, hi):
            st = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120), False)
            stores.append(st)
            if st.add("joined", 1) == workers:
                st.set("go", "1")
        joined.append(hi - lo)

    threads = [threading.Thread(target=join, args=(k * workers // 16, (k + 1) * workers // 16)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for st in stores:
        st.wait(["go"])
    join_s = time.monotonic() - t0
    after_join = cpu_and_rss(pid)[0]
    print(f"tcpstore anchor: workers {workers}  all joined in {join_s:.3f} s")

    lat = []
    lock = threading.Lock()
    start = time.monotonic()

    def beat(k, nthreads):
        mine = list(range(k, workers, nthreads))
        local = []
        rnd = 0
        while True:
            base_t = start + rnd
            if base_t >= start + seconds:
                break
            for i in mine:
                at = base_t + i / workers
                d = at - time.monotonic()
                if d > 0:
                    time.sleep(d)
                t = time.monotonic()
                stores[i].set(f"hb/{i}", str(rnd))
                local.append((time.monotonic() - t) * 1000)
            rnd += 1
        with lock:
            lat.extend(local)

    ts = [threading.Thread(target=beat, args=(k, 16)) for k in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    hb_s = time.monotonic() - start
    cpu, rss, hwm = cpu_and_rss(pid)
    print(f"heartbeats answered {len(lat)} over {hb_s:.1f} s")
    print(f"heartbeat latency ms: p50 {pct(lat, 50):.3f}  p90 {pct(lat, 90):.3f}  p99 {pct(lat, 99):.3f}  max {max(lat):.3f}")
    print(f"store server cpu: join phase {after_join - base:.2f} s, heartbeat phase {cpu - after_join:.2f} s "
          f"({100 * (cpu - after_join) / hb_s:.1f}% of one core)")
    print(f"store server memory: rss {rss / 1024:.1f} MiB, peak {hwm / 1024:.1f} MiB")
    stop.set()
    server.join(timeout=10)


if __name__ == "__main__":
    main()
