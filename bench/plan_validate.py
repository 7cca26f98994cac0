#!/usr/bin/python3
"""trn-plan's predictions (step time, peak RSS) against measured trn-train runs.

For each layout of the list below (--set 3d: the dp / tp / pp layouts the suite's layout and
multi-host tests run; --set dims: ZeRO-3, hybrid sharding, recomputation, sequence, context (ring
and all-to-all) and expert parallelism, and mixes of 4 or more dimensions; --set all, the default:
both) it measures trn-train's step time and peak RSS, asks trn-plan for its prediction of the same layout
on the same cluster shape, and prints a markdown table with the errors, then whether trn-plan's
first choice within each test case (same hosts, ranks per host and link delay) is the layout
measured fastest.

Measured runs. Every process gets 1 compute thread (--threads 1, OPENBLAS_NUM_THREADS=1). On one
host: trn-train alone (1 process) or `trnrun --nproc-per-node N -- trn-train ...`. On the test
bed (tests/multihost/testbed.sh, root only): as tests/multihost/cluster/cluster_test.cc does, a
bed of H + 1 hosts, trn-coordinator in host 0 (a new one per run), and trnrun in each of the
worker hosts 1..H (--coordinator ADDR:PORT --job-id ID --nnodes H --nproc-per-node K
--node-rank k-1). A link delay D is `testbed.sh netem NAME k "delay Dms"` on every worker host's
link; a packet between two worker hosts crosses two such links, so the one-way delay between
hosts is 2D. Step time: the median of the timed steps' own times (elapsed_s differences after
`warmup` steps) from rank 0's --metrics-jsonl; peak RSS: the largest "peak RSS N MB" any rank
logs. Each layout runs once per round (--rounds, layout order reversed every other round), again
(--tries) while the host steals more than --max-steal of the CPU; the table shows the fastest
round (--estimator min, the default: other tenants of a shared host only ever slow a run down,
so the fastest round is closest to the machine's own speed, which trn-plan calibrate also takes)
or the median.

Predictions. `trn-plan calibrate --model M --seq-len T --out FILE` once per model (--model, and
--moe-model for the expert-parallel layouts, which train a mixture of experts and are compared only
with the layouts of the same model and case), then per test case a
copy of FILE with "hosts" (1 on one host) and "inter_node"."delay_us" set, and
`trn-plan --model M --cluster local:COPY --global-batch B --seq-len T --layout "FLAGS" --json`
per layout (layouts[0] of its output). Without build/.../trn-plan only the measured table is
printed. The mixture of experts' layouts also get `--moe-loads`: the expert loads of a one-process
trn-train run of the same steps (`--metrics-moe-loads`), whose routing every layout shares.

--speed-reference (with --calibrate-each-round): this machine's speed drifts by 10-15% over
minutes, more than the model's own error. Right after each calibration, and right before each
layout's run, a one-process trn-train run of the layout's model at the job's batch (3 timed
steps after 2) gives the speed of the moment; each run's prediction is its round's, times the
reference before the run over the reference after the calibration. The references time the
machine, never the layout.

  sudo /usr/bin/python3 bench/plan_validate.py [--bin build/release/bin] [--rounds 3] [--set all|3d|dims]
      [--model small --seq-len 128 --batch-size 16] [--moe-model moe-small] [--n-layer N] [--precision bf16]
      [--steps 6 --warmup 2] [--delay-ms 1] [--only REGEX] [--no-bed] [--list]
      [--out bench/results/DATE-plan-validate.md] [--save-json FILE] [--from-json FILE]
      [--work-dir DIR] [--keep-cluster FILE]

Smoke test (seconds): --model tiny --n-layer 4 --seq-len 64 --batch-size 8 --steps 3 --warmup 1
--rounds 1 (tiny has 2 layers; the interleaved layout, --pp 2 x --virtual-stages 2, needs 4).

ZeRO stages (--zero-memory): per --precisions, the base as trn-plan calibrate measures it (trn-train's
peak RSS less the plan's count at --dp 2 over shm, batch 4), then `trnrun --nproc-per-node DP --
trn-train --dp DP --zero Z` for each of --stages; a table per precision of the plan's count (the
"memory plan" line trn-train logs) plus the base against the largest peak RSS of the ranks, and the
model state per rank (weights + gradients at rest + AdamW) relative to ZeRO-0's:

  /usr/bin/python3 bench/plan_validate.py --zero-memory --model gpt2 --dp 4 --batch-size 4
      --seq-len 64 --steps 2 [--stages 0,1,2,3] [--precisions fp32,bf16] [--out FILE]

--only REGEX keeps the layouts whose "case: flags" label matches (re.search), e.g.
--only '^1 host' or --only 'pp 2'. --from-json reuses the measurements of an earlier
--save-json (same layouts) and only asks trn-plan again.
"""
import argparse
import atexit
import contextlib
import copy
import datetime
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTBED = os.path.join(ROOT, "tests", "multihost", "testbed.sh")


class Case:
    """A test case: where the ranks run. hosts 0 is one host without the test bed."""

    def __init__(self, bed_hosts, per_host, delay_ms=0.0):
        self.bed_hosts, self.per_host, self.delay_ms = bed_hosts, per_host, delay_ms

    @property
    def hosts(self):
        return max(1, self.bed_hosts)

    @property
    def world(self):
        return self.hosts * self.per_host

    @property
    def one_way_us(self):
        # A packet between two worker hosts crosses both hosts' links, each delayed delay_ms.
        return int(round(2 * self.delay_ms * 1000)) if self.bed_hosts > 1 else 0

    @property
    def name(self):
        if not self.bed_hosts:
            return f"1 host x {self.per_host}"
        s = f"bed {self.bed_hosts} x {self.per_host}"
        if self.delay_ms:
            s += f", netem {self.delay_ms:g} ms"
        return s


class Layout:
    """A trn-train layout (its flags) in a case; model None: --model's, else this preset (the MoE
    layouts' mixture of experts), which trn-plan calibrate measures on its own."""

    def __init__(self, case, flags, model=None):
        self.case, self.flags, self.model = case, flags, model

    @property
    def flag_text(self):
        return " ".join(self.flags)

    @property
    def label(self):
        tag = f"[{self.model}] " if self.model else ""
        return f"{self.case.name}: {tag}{self.flag_text or '(one process)'}"

    @property
    def group(self):
        """The comparison group: the same case and model (a layout ranks only against the layouts of
        the same job)."""
        return self.case.name + (f" [{self.model}]" if self.model else "")


def layouts(a):
    pp = ["--pp", "2", "--micro-batches", "4"]
    one, two, four = Case(0, 1), Case(0, 2), Case(0, 4)
    b2, b2d, b4, b22 = Case(2, 1), Case(2, 1, a.delay_ms), Case(4, 1), Case(2, 2)
    out = [Layout(one, []),
           Layout(two, ["--dp", "2"]),
           Layout(two, ["--tp", "2"])]
    for sched in ("1f1b", "gpipe", "zb"):
        out.append(Layout(two, pp + ["--schedule", sched]))
    out.append(Layout(two, pp + ["--schedule", "interleaved", "--virtual-stages", "2"]))
    out += [Layout(four, ["--dp", "4"]),
            Layout(four, ["--dp", "2", "--tp", "2"]),
            Layout(four, ["--dp", "2"] + pp + ["--schedule", "1f1b"]),
            Layout(four, ["--tp", "2"] + pp + ["--schedule", "1f1b"])]
    for case in (b2, b2d):
        out += [Layout(case, ["--dp", "2"]),
                Layout(case, pp + ["--schedule", "1f1b"]),
                Layout(case, ["--tp", "2"])]
    out += [Layout(b4, ["--dp", "4"]),
            Layout(b4, ["--dp", "2"] + pp + ["--schedule", "1f1b"]),
            Layout(b4, ["--dp", "2", "--tp", "2"]),
            Layout(b22, ["--dp", "4"]),
            Layout(b22, ["--dp", "2", "--tp", "2"])]
    out = {"3d": out, "dims": dim_layouts(a), "all": out + dim_layouts(a)}[a.set]
    if a.only:
        out = [l for l in out if re.search(a.only, l.label)]
    if a.no_bed:
        out = [l for l in out if not l.case.bed_hosts]
    return out


def dim_layouts(a):
    """The layouts of the other dimensions: ZeRO-3, hybrid sharding, recomputation, sequence
    parallelism, context parallelism (ring and all-to-all), expert parallelism (on --moe-model) and
    mixes of 4 or more; each on one host and on the beds, with and without the link delay."""
    one, two, four = Case(0, 1), Case(0, 2), Case(0, 4)
    b2, b2d, b4, b22 = Case(2, 1), Case(2, 1, a.delay_ms), Case(4, 1), Case(2, 2)
    z3, sp = ["--zero", "3"], ["--sequence-parallel"]
    out = [
        # ZeRO-3: the weights gathered block by block, the gradients reduce-scattered.
        Layout(two, ["--dp", "2"] + z3),
        Layout(four, ["--dp", "4"] + z3),
        Layout(b2, ["--dp", "2"] + z3),
        Layout(b2d, ["--dp", "2"] + z3),
        # Hybrid sharding: ZeRO within groups of 2 replicas, an all-reduce across the groups.
        Layout(four, ["--dp", "4", "--zero", "3", "--shard-group", "2"]),
        Layout(b4, ["--dp", "4", "--zero", "3", "--shard-group", "2"]),
        Layout(b22, ["--dp", "4", "--zero", "3", "--shard-group", "2"]),
        # Recomputation: selective (the norms' and GELU's outputs) and full (each block's forward).
        Layout(one, ["--recompute", "selective"]),
        Layout(one, ["--recompute", "full"]),
        Layout(two, ["--dp", "2", "--recompute", "full"]),
        Layout(b2, ["--tp", "2", "--recompute", "selective"]),
        # Sequence parallelism under tp.
        Layout(two, ["--tp", "2"] + sp),
        Layout(four, ["--dp", "2", "--tp", "2"] + sp),
        Layout(b2, ["--tp", "2"] + sp),
        Layout(b2d, ["--tp", "2"] + sp),
        # Context parallelism: ring attention and the all-to-all (Ulysses) exchange.
        Layout(two, ["--cp", "2"]),
        Layout(two, ["--cp", "2", "--cp-comm", "all-to-all"]),
        Layout(four, ["--cp", "4"]),
        Layout(four, ["--cp", "4", "--cp-comm", "all-to-all"]),
        Layout(b2, ["--cp", "2"]),
        Layout(b2d, ["--cp", "2", "--cp-comm", "all-to-all"]),
        # Mixes of 4 or more dimensions.
        Layout(four, ["--dp", "2", "--cp", "2"] + z3 + ["--recompute", "full"]),
        Layout(b22, ["--dp", "2", "--tp", "2"] + sp + z3 + ["--recompute", "selective"]),
    ]
    # Expert parallelism: a mixture of experts, with the same job without ep beside it.
    moe = a.moe_model
    out += [Layout(two, ["--dp", "2"], moe),
            Layout(two, ["--dp", "2", "--ep", "2"], moe),
            Layout(four, ["--dp", "4", "--ep", "4"], moe),
            Layout(b2, ["--dp", "2", "--ep", "2"], moe),
            Layout(b2d, ["--dp", "2", "--ep", "2"], moe)]
    return out


# ---- processes ---------------------------------------------------------------------------------

_live = set()  # Popen objects still running (each the leader of its own session)
_beds = []     # beds made by this script, removed at exit


def _stop(p, grace=15):
    """SIGTERM to the process group we started (trnrun forwards it to its workers), then SIGKILL."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass
    _live.discard(p)


def start(cmd, log, env=None):
    f = open(log, "w")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                         start_new_session=True)
    f.close()
    _live.add(p)
    return p


def wait_all(procs, timeout):
    """Waits for every process; at the deadline stops what still runs. Returns (exit codes, timed out)."""
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            _stop(p)
    for p in procs:
        _live.discard(p)
    return [p.returncode for p in procs], timed_out


def cleanup():
    for p in list(_live):
        _stop(p, grace=5)
    while _beds:
        _beds.pop().down()


def _on_signal(sig, _frame):
    raise SystemExit(f"plan_validate: signal {sig}, cleaning up")


class RunError(Exception):
    pass


def tail(text, n=25):
    return "\n".join(text.rstrip().splitlines()[-n:])


# ---- test bed ----------------------------------------------------------------------------------

class Bed:
    """H worker hosts 1..H and host 0 for the coordinator (tests/multihost/bed.h, cluster_test.cc)."""

    def __init__(self, a, workers):
        self.workers = workers
        self.name = f"pv{workers}{os.getpid() % 100000}"[:8]
        self.env = dict(os.environ, TESTBED_OWNER=str(os.getpid()),
                        TRN_NETDELAY=os.path.join(a.bin, "trn-netdelay"))
        self.delay = None
        _beds.append(self)
        self.sh("up", self.name, str(workers + 1))
        self.delay = 0.0

    def sh(self, *args):
        out = subprocess.run([TESTBED] + list(args), env=self.env, capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RunError(f"testbed.sh {' '.join(args)} failed: {out.stdout}{out.stderr}")
        return out.stdout.strip()

    def addr(self, k):
        return self.sh("addr", self.name, str(k))

    def exec_argv(self, k, argv):
        return [TESTBED, "exec", self.name, str(k)] + argv

    def set_delay(self, ms):
        if self.delay == ms:
            return
        for k in range(1, self.workers + 1):
            self.sh("netem", self.name, str(k), f"delay {ms:g}ms" if ms else "")
        self.delay = ms

    def link(self, a, work, delay_ms):
        """alpha (us) and beta (us per KiB) of the link between two worker hosts under the case's
        delay, as trn-plan calibrate measures this host's: a 2-rank ring all-reduce after each run of
        the model's block forward (trn-plan probe-link), medians of 3 runs, fitted to 2 alpha +
        size beta;
        None without trn-plan."""
        if not os.access(os.path.join(a.bin, "trn-plan"), os.X_OK):
            return None
        self.set_delay(delay_ms)
        times = {}
        for r in range(3):
            store = os.path.join(work, f"link-{self.name}-{delay_ms:g}-{r}")
            os.makedirs(store, exist_ok=True)
            procs = []
            for rank in (0, 1):
                env = dict(self.env, TRN_STORE_DIR=store, TRN_RANK=str(rank), TRN_WORLD_SIZE="2",
                           TRN_LOG_LEVEL="error", TRN_FABRIC_PROVIDER="tcp", OPENBLAS_NUM_THREADS="1")
                argv = [os.path.join(a.bin, "trn-plan"), "probe-link", "--model", a.model, "--seq-len",
                        str(a.seq_len)] + model_flags(a)
                procs.append(subprocess.Popen(self.exec_argv(rank + 1, argv), env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True))
            out = procs[0].communicate(timeout=300)[0]
            procs[1].wait(timeout=60)
            for line in out.splitlines():
                w = line.split()
                if len(w) >= 2 and w[0].isdigit():  # SIZE MEDIAN_US [MEAN_US P90_US]
                    times.setdefault(int(w[0]), []).append(float(w[1]))
        pts = {sz: statistics.median(v) for sz, v in times.items()}
        sw = ss = sss = st = sst = 0.0
        for sz, t in pts.items():
            wgt, kib = 1 / (t * t), sz / 1024
            sw += wgt; ss += wgt * kib; sss += wgt * kib * kib; st += wgt * t; sst += wgt * kib * t
        det = sw * sss - ss * ss
        if len(pts) < 3 or det <= 0:
            return None
        alpha, beta = (sss * st - ss * sst) / det, (sw * sst - ss * st) / det
        # The slope holds the reduction too, as the cost model charges it (tcp: gamma 0.12 us/KiB,
        # half of it hidden): the link is the rest (trn-plan calibrate's fit_link).
        return {"alpha_us": max(1.0, alpha / 2), "beta_us_per_kib": beta - 0.12 * (1 - 0.5) / 2}

    def down(self):
        subprocess.run([TESTBED, "down", self.name], env=self.env, capture_output=True, timeout=120)


# ---- measurement -------------------------------------------------------------------------------

def model_of(a, lay=None):
    return lay.model if lay is not None and lay.model else a.model


def model_flags(a, model=None):
    """Flags beyond --model that trn-train and trn-plan both get; model: a layout's own preset
    (Layout.model), which keeps its layer count (--n-layer is --model's)."""
    out = []
    if a.n_layer and not model:
        out += ["--n-layer", str(a.n_layer)]
    if a.precision:
        out += ["--precision", a.precision]
    return out


def train_argv(a, lay, metrics):
    argv = [os.path.join(a.bin, "trn-train"), "--model", model_of(a, lay), "--steps", str(a.steps + a.warmup),
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--threads", "1",
            "--log-every", "1000", "--metrics-jsonl", metrics]
    return argv + model_flags(a, lay.model) + lay.flags


def parse_run(a, metrics, output):
    try:
        rows = [json.loads(l) for l in open(metrics) if l.strip()]
    except OSError as e:
        raise RunError(f"no metrics: {e}")
    steps = [r for r in rows if "step" in r and "elapsed_s" in r]
    if len(steps) < a.warmup + 1:
        raise RunError(f"{len(steps)} step rows in {metrics}, expected {a.steps + a.warmup}")
    # The median of the timed steps' own times: a step the shared host stalls does not count.
    times = [steps[i]["elapsed_s"] - (steps[i - 1]["elapsed_s"] if i else 0.0) for i in range(a.warmup, len(steps))]
    step_s = statistics.median(times)
    rss = [float(x) for x in re.findall(r"peak RSS ([0-9.]+) MB", output)]
    if not rss:
        raise RunError("no 'peak RSS' line in the output")
    return step_s, max(rss)


def run_local(a, lay, work, n):
    metrics = os.path.join(work, f"run{n}.jsonl")
    log = os.path.join(work, f"run{n}.log")
    cmd = train_argv(a, lay, metrics)
    if lay.case.world > 1:
        cmd = [os.path.join(a.bin, "trnrun"), "--nproc-per-node", str(lay.case.world), "--"] + cmd
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    p = start(cmd, log, env)
    (rc,), timed_out = wait_all([p], a.timeout)
    output = open(log).read()
    if timed_out or rc != 0:
        raise RunError(f"{'timed out' if timed_out else f'exit {rc}'}: {shlex.join(cmd)}\n{tail(output)}")
    return parse_run(a, metrics, output)


def run_bed(a, bed, lay, work, n):
    bed.set_delay(lay.case.delay_ms)
    metrics = os.path.join(work, f"run{n}.jsonl")
    port_file = os.path.join(work, f"run{n}.port")
    if os.path.exists(port_file):  # a --work-dir used before: that run's port is not this one's
        os.remove(port_file)
    env = dict(bed.env, OPENBLAS_NUM_THREADS="1")
    coord = start(bed.exec_argv(0, [os.path.join(a.bin, "trn-coordinator"), "--listen", bed.addr(0) + ":0",
                                    "--port-file", port_file]),
                  os.path.join(work, f"run{n}.coordinator.log"), env)
    nodes = []
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if coord.poll() is not None or time.monotonic() > deadline:
                raise RunError("trn-coordinator did not start: " +
                               tail(open(os.path.join(work, f"run{n}.coordinator.log")).read()))
            time.sleep(0.02)
        address = bed.addr(0) + ":" + open(port_file).read().strip()
        job = f"pv{os.getpid()}-{n}"
        logs, cmds = [], []
        for k in range(1, lay.case.bed_hosts + 1):
            cmd = bed.exec_argv(k, [os.path.join(a.bin, "trnrun"), "--coordinator", address, "--job-id", job,
                                    "--nnodes", str(lay.case.bed_hosts), "--nproc-per-node", str(lay.case.per_host),
                                    "--node-rank", str(k - 1), "--"] + train_argv(a, lay, metrics))
            logs.append(os.path.join(work, f"run{n}.host{k}.log"))
            cmds.append(cmd)
            nodes.append(start(cmd, logs[-1], env))
        codes, timed_out = wait_all(nodes, a.timeout)
        outputs = [open(l).read() for l in logs]
        if timed_out or any(codes):
            bad = [k for k, c in enumerate(codes) if c != 0] or [0]
            raise RunError(f"{'timed out' if timed_out else f'exit codes {codes}'}: {shlex.join(cmds[bad[0]])}\n"
                           f"{tail(outputs[bad[0]])}")
        return parse_run(a, metrics, "".join(outputs))
    finally:
        for p in nodes:
            if p.poll() is None:
                _stop(p)
        _stop(coord, grace=10)


def cpu_ticks():
    """(steal, total) jiffies of the machine so far (/proc/stat's cpu line)."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return v[7], sum(v[:8])


def quiet(run, a, what):
    """run() again (up to --tries times) while the hypervisor stole more than --max-steal of the
    CPU during it; the result with the least steal, and that steal."""
    best = None
    for attempt in range(a.tries):
        s0, t0 = cpu_ticks()
        result = run()
        s1, t1 = cpu_ticks()
        steal = (s1 - s0) / max(1, t1 - t0)
        if best is None or steal < best[1]:
            best = (result, steal)
        if steal <= a.max_steal:
            break
        print(f"  {what}: {100 * steal:.0f}% of the CPU stolen by the host, again", flush=True)
    return best


def reference(a, model, work, n):
    """The machine's speed now (--speed-reference): the median timed step of a one-process run of
    model (None: --model's) at the job's batch, 3 timed steps after 2 warm-up."""
    metrics = os.path.join(work, f"ref{n}.jsonl")
    argv = [os.path.join(a.bin, "trn-train"), "--model", model or a.model, "--steps", "5",
            "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--threads", "1",
            "--log-every", "1000", "--metrics-jsonl", metrics] + model_flags(a, model)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout,
                         env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RunError(f"the speed reference failed (exit {out.returncode}): {tail(out.stdout + out.stderr, 3)}")
    e = [json.loads(l)["elapsed_s"] for l in open(metrics) if l.strip()]
    return statistics.median(e[i] - e[i - 1] for i in range(2, len(e)))


def measure(a, todo, work):
    beds, links = {}, {}
    runs = itertools.count(1)  # every attempt its own files (a retried bed run must not read an old port)
    res = {l.label: [] for l in todo}
    errors = {}
    n = 0
    try:
        for r in range(a.rounds):
            if a.calibrate_each_round:
                # This round's own calibration: the host's speed drifts over minutes, so each round's
                # runs are predicted from parts measured next to them.
                # A model whose calibration fails goes unpredicted (predict() says so).
                for m in models_in(todo):
                    path = cluster_file(os.path.join(work, f"cluster-round{r}.json"), m)
                    ref_path = path[:-len(".json")] + ".ref"
                    if os.path.exists(ref_path):
                        os.remove(ref_path)  # an earlier run's, in a reused --work-dir
                    problem = calibrate(a, path, m)
                    if problem:
                        print(f"round {r + 1}: {problem}", flush=True)
                    elif a.speed_reference:
                        # The machine's speed as the calibration saw it, beside its file (none: this
                        # round's runs are predicted at the calibration's speed).
                        try:
                            ref = reference(a, m, work, next(runs))
                        except (RunError, subprocess.TimeoutExpired, OSError, ValueError,
                                statistics.StatisticsError) as e:
                            print(f"round {r + 1}: no speed reference after calibrating: {e}", flush=True)
                            continue
                        with open(ref_path + ".tmp", "w") as f:  # whole or absent: a kill leaves no half
                            f.write(f"{ref}\n")
                        os.replace(ref_path + ".tmp", ref_path)
                        print(f"round {r + 1}: speed reference after calibrating {m or a.model}: {ref:.4f} s/step",
                              flush=True)
            order = todo if r % 2 == 0 else list(reversed(todo))
            for lay in order:
                n += 1
                try:
                    try:
                        ref = reference(a, lay.model, work, next(runs)) if a.speed_reference else None
                    except (subprocess.TimeoutExpired, OSError, ValueError, statistics.StatisticsError) as e:
                        raise RunError(f"the speed reference: {e}")
                    if lay.case.bed_hosts:
                        h = lay.case.bed_hosts
                        if h not in beds:
                            beds[h] = Bed(a, h)
                        key = f"{h}/{lay.case.delay_ms:g}"
                        if key not in links:
                            links[key] = beds[h].link(a, work, lay.case.delay_ms)
                            print(f"bed of {h} hosts, delay {lay.case.delay_ms:g} ms: link {links[key]}", flush=True)
                        (step_s, rss), steal = quiet(lambda: run_bed(a, beds[h], lay, work, next(runs)), a, lay.label)
                    else:
                        (step_s, rss), steal = quiet(lambda: run_local(a, lay, work, next(runs)), a, lay.label)
                except RunError as e:
                    errors.setdefault(lay.label, str(e))
                    why = [l for l in str(e).splitlines() if "error" in l] or str(e).splitlines()[:1]
                    print(f"round {r + 1} {lay.label:55s} FAILED: {why[-1]}", flush=True)
                    continue
                res[lay.label].append((step_s, rss, r, ref))
                print(f"round {r + 1} {lay.label:55s} {step_s:8.4f} s/step  peak RSS {rss:.0f} MB  "
                      f"steal {100 * steal:.0f}%" + (f"  reference {ref:.4f} s" if ref else ""), flush=True)
    finally:
        for b in beds.values():
            b.down()
            if b in _beds:
                _beds.remove(b)
    return res, errors, links


# ---- predictions -------------------------------------------------------------------------------

def plan_flags(lay):
    return lay.flag_text or "--dp 1"


def models_in(todo):
    """The layouts' own models (None: --model's), --model's first."""
    return sorted({l.model for l in todo}, key=lambda m: (m is not None, m or ""))


def cluster_file(base, model):
    """Where trn-plan calibrate's file for a layout's model goes: base for --model's."""
    return base if not model else base[:-len(".json")] + f"-{model}.json"


def calibrate(a, base, model=None):
    """Runs trn-plan calibrate for model (None: --model) into base; None, or what went wrong."""
    plan = os.path.join(a.bin, "trn-plan")
    cmd = [plan, "calibrate", "--model", model or a.model, "--seq-len", str(a.seq_len), "--out", base] + \
        model_flags(a, model) + ["--threads", "1", "--repeats", str(a.calibrate_repeats)]
    print("calibrating: " + shlex.join(cmd), flush=True)
    out, steal = quiet(lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                              env=dict(os.environ, OPENBLAS_NUM_THREADS="1")), a, "calibrate")
    print(f"calibrated with {100 * steal:.0f}% of the CPU stolen", flush=True)
    if out.returncode != 0:
        return f"trn-plan calibrate failed (exit {out.returncode}): {tail(out.stdout + out.stderr, 10)}"
    return None


_routed = set()  # the routing runs' files this invocation made (predict)


def predict(a, todo, work, links, base=None):
    """{label: layouts[0] of trn-plan --json}, {label: error}, a note for the report; from the
    calibrations in base (cluster_file(base, model) for each layout's model), or new ones."""
    plan = os.path.join(a.bin, "trn-plan")
    if not os.access(plan, os.X_OK):
        return {}, {}, f"no {plan}: measured values only"
    fresh = base is None
    if fresh:
        base = os.path.join(work, "cluster.json")
    clusters, notes, errors = {}, [], {}
    for m in models_in(todo):
        path = cluster_file(base, m)
        problem = calibrate(a, path, m) if fresh else None
        if not problem:
            try:
                clusters[m] = json.load(open(path))
            except (OSError, ValueError) as e:
                problem = f"trn-plan calibrate wrote no readable {path}: {e}"
        if problem:
            # That model's layouts go unpredicted; the other models' are still compared.
            notes.append(f"{m or a.model}: {problem}")
            for lay in todo:
                if lay.model == m:
                    errors[lay.label] = problem
    note = "; ".join(notes)
    if a.keep_cluster:
        keep = a.keep_cluster if a.keep_cluster.endswith(".json") else a.keep_cluster + ".json"
        for m, cluster in clusters.items():
            with open(cluster_file(keep, m), "w") as f:
                json.dump(cluster, f, indent=2)
    # The mixture of experts' routing, measured by one process over the runs' own steps (any layout
    # routes as one process does): trn-plan --moe-loads waits for and holds expert parallelism's
    # busiest rank.
    routing = {}
    for m in clusters:
        if m is None or m != a.moe_model:
            continue
        path = os.path.join(work, f"routing-{m}.jsonl")
        if path in _routed:  # measured once per invocation: every round routes alike
            routing[m] = path
            continue
        if os.path.exists(path):
            os.remove(path)
        cmd = train_argv(a, Layout(None, [], m), path) + ["--metrics-moe-loads"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                             env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
        if out.returncode != 0:
            notes.append(f"{m}: the routing run failed (exit {out.returncode}), routing taken as balanced: "
                         f"{tail(out.stdout + out.stderr, 3)}")
            continue
        routing[m] = path
        _routed.add(path)
    preds, files = {}, {}
    for lay in todo:
        if lay.model not in clusters:
            continue
        c = lay.case
        key = (c.name, lay.model)
        if key not in files:
            edited = copy.deepcopy(clusters[lay.model])
            edited["hosts"] = c.hosts
            # The bed's hosts are namespaces of this one machine: they share its cores.
            edited["hosts_share_cores"] = c.bed_hosts > 0
            if not isinstance(edited.get("inter_node"), dict):
                edited["inter_node"] = {}
            edited["inter_node"]["delay_us"] = c.one_way_us
            link = links.get(f"{c.bed_hosts}/{c.delay_ms:g}") if c.bed_hosts else None
            if link:
                # Measured across the bed under the case's delay: the delay is in it already.
                edited["inter_node"].update(link)
                edited["inter_node"]["delay_us"] = 0
            files[key] = base[:-len(".json")] + f"-case{len(files)}.json"
            with open(files[key], "w") as f:
                json.dump(edited, f, indent=2)
        cmd = [plan, "--model", model_of(a, lay), "--cluster", "local:" + files[key], "--global-batch",
               str(a.batch_size), "--seq-len", str(a.seq_len), "--layout", plan_flags(lay), "--json"] + \
            model_flags(a, lay.model) + ["--threads", "1"]
        if lay.model in routing:
            cmd += ["--moe-loads", routing[lay.model]]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        try:
            if out.returncode != 0:
                raise ValueError(f"exit {out.returncode}")
            p = json.loads(out.stdout)["layouts"][0]
            p = {"step_s": float(p["step_s"]), "peak_rss_mib": float(p["peak_rss_mib"]),
                 "fits": bool(p.get("fits", True)), "breakdown": p.get("breakdown"), "memory": p.get("memory")}
            preds[lay.label] = p
        except (ValueError, KeyError, IndexError, TypeError) as e:
            errors[lay.label] = f"{shlex.join(cmd)}: {e}\n{tail(out.stdout + out.stderr, 10)}"
    return preds, errors, note


# ---- report ------------------------------------------------------------------------------------

def err_pct(pred, meas):
    return 100.0 * (pred - meas) / meas


def report(a, todo, meas, merr, preds, perr, note, paired=None):
    lines = []
    add = lines.append
    moe = sorted({l.model for l in todo if l.model})
    add(f"model {a.model}{' ' + ' '.join(model_flags(a)) if model_flags(a) else ''}"
        f"{' (layouts marked [M]: model M)' if moe else ''}, global batch {a.batch_size} x {a.seq_len}, "
        f"1 compute thread per process, {a.steps} timed steps after {a.warmup} warm-up, "
        f"{'each round predicted from its own calibration, medians' if paired else 'fastest' if a.estimator == 'min' else 'median'} of {a.rounds} round(s); bed link delay: netem {a.delay_ms:g} ms on each worker host's link "
        f"({2 * a.delay_ms:g} ms one way between hosts)")
    if note:
        add(f"\n**Note: {note}.**")
    add("")
    add("| case | layout | measured step s | predicted step s | error % | measured peak RSS MB "
        "| predicted MB | error % | fits |")
    add("|---|---|---|---|---|---|---|---|---|")
    step_errs, rss_errs, med = [], [], {}
    for lay in todo:
        runs = meas.get(lay.label, [])
        pick = min if a.estimator == "min" and not paired else statistics.median
        ms = pick(x[0] for x in runs) if runs else None
        mr = statistics.median(x[1] for x in runs) if runs else None
        med[lay.label] = ms
        p = preds.get(lay.label)
        cells = [lay.case.name, lay.label.split(": ", 1)[1]]
        cells.append(f"{ms:.4f}" if ms is not None else "failed")
        if p:
            cells.append(f"{p['step_s']:.4f}")
            if ms:
                e = paired[lay.label] if paired and lay.label in paired else err_pct(p["step_s"], ms)
                step_errs.append(abs(e))
                cells.append(f"{e:+.1f}")
            else:
                cells.append("")
        else:
            cells += ["-" if not preds else "error", ""]
        cells.append(f"{mr:.0f}" if mr is not None else "failed")
        if p:
            cells.append(f"{p['peak_rss_mib']:.0f}")
            if mr:
                e = err_pct(p["peak_rss_mib"], mr)
                rss_errs.append(abs(e))
                cells.append(f"{e:+.1f}")
            else:
                cells.append("")
            cells.append("yes" if p["fits"] else "no")
        else:
            cells += ["-" if not preds else "error", "", ""]
        add("| " + " | ".join(cells) + " |")
    add("")
    if step_errs:
        add(f"step time: median |error| {statistics.median(step_errs):.1f}%, max {max(step_errs):.1f}% "
            f"({len(step_errs)} layouts)")
    if rss_errs:
        add(f"peak RSS: median |error| {statistics.median(rss_errs):.1f}%, max {max(rss_errs):.1f}% "
            f"({len(rss_errs)} layouts)")
    if preds:
        groups = {}
        for lay in todo:
            p = preds.get(lay.label)
            if p and p["fits"] and med.get(lay.label) is not None:
                groups.setdefault(lay.group, []).append(lay)
        hits, cases = 0, 0
        for name, lays in groups.items():
            if len(lays) < 2:
                continue
            cases += 1
            chosen = min(lays, key=lambda l: preds[l.label]["step_s"])
            fastest = min(lays, key=lambda l: med[l.label])
            ok = chosen is fastest
            hits += ok
            add(f"- {name}: trn-plan's first choice `{chosen.flag_text or '(one process)'}` "
                f"({med[chosen.label]:.4f} s measured); measured fastest `{fastest.flag_text or '(one process)'}` "
                f"({med[fastest.label]:.4f} s): {'yes' if ok else 'no'}")
        add(f"first choice is the measured fastest in {hits} of {cases} cases")
    problems = [(k, v) for k, v in list(merr.items()) + list(perr.items())]
    if problems:
        add("\nFailures (first error of each):\n")
        for k, v in problems:
            add(f"- {k}:\n```\n{v}\n```")
    return "\n".join(lines)


# ---- ZeRO stages: peak RSS against the plan's count (--zero-memory) ----------------------------

PLAN_RE = re.compile(r"memory plan: ([0-9.]+) MB per rank \(weights ([0-9.]+), gradients ([0-9.]+), AdamW ([0-9.]+), "
                     r"bf16 copy ([0-9.]+), activations ([0-9.]+), buffers ([0-9.]+)\)")
PLAN_FIELDS = ("total", "weights", "gradients", "adamw", "bf16_copy", "activations", "buffers")
MB_PER_MIB = 1048576 / 1e6  # trn-train logs the plan in MB (1e6 bytes) and peak RSS in MiB (ru_maxrss / 1024)


def run_memory(a, argv, log):
    """Runs one trn-train job (argv, under trnrun when it has --dp > 1); its largest plan (MiB by
    field), the largest peak RSS any rank logs (MiB), every rank's peak RSS, and the parameters a
    rank holds."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", TRN_LOG_LEVEL="info")
    p = start(argv, log, env)
    (rc,), timed_out = wait_all([p], a.timeout)
    output = open(log).read()
    if timed_out or rc != 0:
        raise RunError(f"{'timed out' if timed_out else f'exit {rc}'}: {shlex.join(argv)}\n{tail(output)}")
    plans = [dict(zip(PLAN_FIELDS, (float(x) / MB_PER_MIB for x in m))) for m in PLAN_RE.findall(output)]
    rss = [float(x) for x in re.findall(r"peak RSS ([0-9.]+) MB", output)]
    params = [int(x) for x in re.findall(r"([0-9]+) parameters on this rank", output)]
    if not plans or not rss or not params:
        raise RunError(f"no 'memory plan', 'peak RSS' or 'parameters on this rank' line in {log}")
    return max(plans, key=lambda x: x["total"]), max(rss), rss, max(params)


def zero_memory(a, work):
    """--zero-memory: per precision, the base as trn-plan calibrate measures it (2 ranks over shm,
    --dp 2, a global batch of 4 at --seq-len: peak RSS less the plan's count), then one
    `trnrun --nproc-per-node DP -- trn-train --dp DP --zero Z` per stage."""
    b = a.bin
    out = {"base": {}, "runs": {}, "commands": []}
    for prec in a.precisions.split(","):
        # calibrate.cc's base(2, ""): the same job shape and environment.
        argv = [os.path.join(b, "trnrun"), "--nproc-per-node", "2", "--", os.path.join(b, "trn-train"), "--model",
                a.model, "--precision", prec, "--dp", "2", "--steps", "2", "--batch-size", "4", "--seq-len",
                str(a.seq_len), "--threads", "1", "--log-every", "1000"] + (["--n-layer", str(a.n_layer)] if a.n_layer else [])
        out["commands"].append(shlex.join(argv))
        plan, peak, ranks, _ = run_memory(a, argv, os.path.join(work, f"base-{prec}.log"))
        base = max(0.0, peak - plan["total"])
        out["base"][prec] = {"peak": peak, "plan": plan["total"], "base": base}
        print(f"{prec} base: 2 ranks over shm peak RSS {peak:.0f} MiB, plan {plan['total']:.0f} MiB: base {base:.0f} MiB",
              flush=True)
        for z in [int(x) for x in a.stages.split(",")]:
            argv = [os.path.join(b, "trnrun"), "--nproc-per-node", str(a.dp), "--", os.path.join(b, "trn-train"),
                    "--model", a.model, "--precision", prec, "--dp", str(a.dp), "--zero", str(z), "--steps",
                    str(a.steps), "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--threads", "1",
                    "--log-every", "1000"] + (["--n-layer", str(a.n_layer)] if a.n_layer else [])
            out["commands"].append(shlex.join(argv))
            t0 = time.monotonic()
            plan, peak, ranks, params = run_memory(a, argv, os.path.join(work, f"zero{z}-{prec}.log"))
            out["runs"][f"{prec}/{z}"] = {"plan": plan, "peak": peak, "ranks": ranks, "params": params}
            print(f"{prec} --zero {z}: plan {plan['total']:.0f} MiB + base {base:.0f}, peak RSS {peak:.0f} MiB "
                  f"(ranks {', '.join(f'{x:.0f}' for x in ranks)}), {time.monotonic() - t0:.0f} s", flush=True)
    return out


def zero_memory_report(a, res):
    lines = []
    add = lines.append
    for prec in a.precisions.split(","):
        if prec not in res["base"]:
            continue
        base = res["base"][prec]["base"]
        add(f"\n{prec}: base {base:.0f} MiB (2 ranks over shm, --dp 2, batch 4 x {a.seq_len}: peak RSS "
            f"{res['base'][prec]['peak']:.0f} MiB less the plan's {res['base'][prec]['plan']:.0f} MiB)\n")
        add("| --zero | weights | gradients (step / at rest) | AdamW | bf16 copy | activations | buffers "
            "| plan + base MiB | peak RSS MiB (max of ranks) | ratio | within 10% | model state MiB | vs ZeRO-0 |")
        add("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        state0 = None
        for z in [int(x) for x in a.stages.split(",")]:
            r = res["runs"].get(f"{prec}/{z}")
            if not r:
                add(f"| {z} | failed |" + " |" * 11)
                continue
            pl = r["plan"]
            whole = 4 * r["params"] / 1048576  # the whole fp32 gradient buffer
            # At rest (between steps) ZeRO-2 and -3 keep only the owned shard, 1/dp of the buffer
            # (during a step: the gradient window, or the whole accumulator, as the plan counts).
            at_rest = whole / a.dp if z >= 2 else pl["gradients"]
            state = pl["weights"] + at_rest + pl["adamw"]
            if z == 0:
                state0 = state
            want = pl["total"] + base
            ratio = r["peak"] / want
            rel = f"{state / state0:.3f}" if state0 else "-"
            add(f"| {z} | {pl['weights']:.0f} | {pl['gradients']:.0f} / {at_rest:.0f} | {pl['adamw']:.0f} | "
                f"{pl['bf16_copy']:.0f} | {pl['activations']:.0f} | {pl['buffers']:.0f} | {want:.0f} | {r['peak']:.0f} | "
                f"{ratio:.3f} | {'yes' if abs(ratio - 1) <= 0.10 else 'no'} | {state:.0f} | {rel} |")
    return "\n".join(lines)


def zero_memory_main(a):
    started = datetime.datetime.now()
    atexit.register(cleanup)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    if a.from_json:
        res = json.load(open(a.from_json))
    else:
        if a.work_dir:
            os.makedirs(a.work_dir, exist_ok=True)
            work_ctx = contextlib.nullcontext(os.path.abspath(a.work_dir))
        else:
            work_ctx = tempfile.TemporaryDirectory(prefix="zero-memory-")
        with work_ctx as work:
            try:
                res = zero_memory(a, work)
            except RunError as e:
                sys.exit(f"plan_validate: {e}")
            finally:
                cleanup()
        res["command"] = shlex.join([sys.executable] + sys.argv)
        res["date"] = started.isoformat()
    text = (f"model {a.model}, --dp {a.dp}, global batch {a.batch_size} x {a.seq_len}, {a.steps} steps, 1 compute "
            f"thread per process; MiB (2^20 bytes); model state = weights + gradients at rest + AdamW (during a "
            f"step ZeRO-2/3 add into a gradient window at one thread and one micro-batch)\n" + zero_memory_report(a, res))
    print("\n" + text)
    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump(res, f, indent=1)
    if a.out:
        when = datetime.datetime.fromisoformat(res["date"]) if "date" in res else started
        runs = "\n".join(f"OPENBLAS_NUM_THREADS=1 TRN_LOG_LEVEL=info {c}".replace(ROOT + "/", "") for c in res.get("commands", []))
        with open(a.out, "w") as f:
            f.write(f"# Peak RSS per rank against the plan's count, ZeRO stages\n\n{when:%Y-%m-%d %H:%M}, "
                    f"{cpu_model()}, {os.cpu_count()} CPUs\n\n```\n{res['command']}\n```\n\nThe runs it made, "
                    f"one after another (each base run first):\n\n```\n{runs}\n```\n\n{text}\n")


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "release", "bin"))
    p.add_argument("--model", default="small")
    p.add_argument("--moe-model", default="moe-small",
                   help="the mixture of experts the expert-parallel layouts train (a preset of runtime/model/mixtral_spec.cc)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="passed to trn-train and trn-plan")
    p.add_argument("--n-layer", type=int,
                   help="override the preset's layer count (trn-train and trn-plan); interleaved needs 4 or more")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--delay-ms", type=float, default=1.0,
                   help="netem delay on each worker host's link in the delayed bed case (one way between "
                        "hosts: twice this)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--set", choices=["all", "3d", "dims"], default="all",
                   help="3d: the dp / tp / pp layouts; dims: ZeRO-3, hybrid sharding, recomputation, sequence, "
                        "context and expert parallelism and their mixes; all: both")
    p.add_argument("--only", help="regex on 'case: flags'")
    p.add_argument("--no-bed", action="store_true", help="skip the test-bed cases")
    p.add_argument("--list", action="store_true", help="print the layouts and exit")
    p.add_argument("--out", help="also write the report (markdown) to this file")
    p.add_argument("--save-json", help="write measurements and predictions to this file")
    p.add_argument("--from-json", help="take the measurements from an earlier --save-json instead of measuring")
    p.add_argument("--calibrate-each-round", action="store_true",
                   help="calibrate at the start of every round and compare each round's runs with its own "
                        "predictions (the error of a layout is the median of its rounds' errors)")
    p.add_argument("--speed-reference", action="store_true",
                   help="with --calibrate-each-round: time a one-process step of the layout's model before each run "
                        "and after each calibration, and predict each run at the speed the machine had then "
                        "(the prediction scaled by the two references' ratio)")
    p.add_argument("--estimator", choices=["min", "median"], default="min",
                   help="a layout's step time over the rounds: the fastest, or the median")
    p.add_argument("--max-steal", type=float, default=0.05,
                   help="a run during which the host stole more of the CPU than this share is run again")
    p.add_argument("--tries", type=int, default=2, help="runs of a layout (or calibration) at most per round")
    p.add_argument("--calibrate-repeats", type=int, default=5, help="trn-plan calibrate --repeats")
    p.add_argument("--keep-cluster", help="copy trn-plan calibrate's cluster file here")
    p.add_argument("--work-dir", help="keep the runs' logs, metrics and cluster files in this directory "
                                      "(default: a temporary one, removed at the end)")
    p.add_argument("--zero-memory", action="store_true",
                   help="instead of the layouts: peak RSS per rank against the plan's count for each --stages "
                        "at --dp (see ZeRO stages below)")
    p.add_argument("--stages", default="0,1,2,3", help="--zero-memory: the ZeRO stages run")
    p.add_argument("--dp", type=int, default=4, help="--zero-memory: data-parallel ranks (processes on this host)")
    p.add_argument("--precisions", default="fp32", help="--zero-memory: comma-separated, fp32 and/or bf16")
    a = p.parse_args()
    a.bin = os.path.abspath(a.bin)
    if a.zero_memory:
        return zero_memory_main(a)
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (the timing starts at the end of a step)")
    if a.speed_reference and not a.calibrate_each_round:
        p.error("--speed-reference compares each run with its round's calibration: add --calibrate-each-round")
    todo = layouts(a)
    if a.list:
        for l in todo:
            print(l.label)
        return
    if not todo:
        sys.exit("no layouts left (--only / --no-bed)")
    if not a.from_json and any(l.case.bed_hosts for l in todo) and os.geteuid() != 0:
        sys.exit("the test-bed cases need root (network namespaces): run as root or pass --no-bed")
    if not a.from_json:
        for b in ("trn-train", "trnrun", "trn-coordinator"):
            if not os.access(os.path.join(a.bin, b), os.X_OK):
                sys.exit(f"no {os.path.join(a.bin, b)}: build first (or give --bin)")
    atexit.register(cleanup)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    started = datetime.datetime.now()
    if a.work_dir:
        os.makedirs(a.work_dir, exist_ok=True)
        work_ctx = contextlib.nullcontext(os.path.abspath(a.work_dir))
    else:
        work_ctx = tempfile.TemporaryDirectory(prefix="plan-validate-")
    with work_ctx as work:
        os.chmod(work, 0o755)
        try:
            if a.from_json:
                saved = json.load(open(a.from_json))
                meas = {k: [tuple(x) for x in v] for k, v in saved["measured"].items()}
                merr = saved.get("measure_errors", {})
                links = saved.get("links", {})
            else:
                meas, merr, links = measure(a, todo, work)
            paired = None
            rounds_kept = all(os.path.exists(os.path.join(work, f"cluster-round{r}.json")) for r in range(a.rounds))
            # (--from-json with --calibrate-each-round predicts again from the rounds' calibrations
            # and speed references kept in --work-dir, when it has them.)
            if a.calibrate_each_round and (not a.from_json or rounds_kept):
                per_round = [predict(a, todo, work, links, os.path.join(work, f"cluster-round{r}.json"))
                             for r in range(a.rounds)]
                preds, perr, note = {}, per_round[0][1], per_round[0][2]
                paired = {}
                def speed(r, lay, ref):
                    """The machine's speed at the layout's run over its speed at round r's calibration
                    (--speed-reference), 1 without references."""
                    path = cluster_file(os.path.join(work, f"cluster-round{r}.json"), lay.model)[:-len(".json")] + ".ref"
                    if not ref or not os.path.exists(path):
                        return 1.0
                    return ref / float(open(path).read())
                for lay in todo:
                    runs = [m for m in meas.get(lay.label, []) if lay.label in per_round[m[2]][0]]
                    if not runs:
                        continue
                    # Each round's prediction at the speed the machine had when the layout ran.
                    ps = [dict(per_round[m[2]][0][lay.label]) for m in runs]
                    for p, m in zip(ps, runs):
                        p["step_s"] *= speed(m[2], lay, m[3] if len(m) > 3 else None)
                    preds[lay.label] = dict(ps[0], step_s=statistics.median(p["step_s"] for p in ps),
                                            peak_rss_mib=statistics.median(p["peak_rss_mib"] for p in ps))
                    paired[lay.label] = statistics.median(err_pct(p["step_s"], m[0]) for p, m in zip(ps, runs))
            else:
                preds, perr, note = predict(a, todo, work, links)
            if note:
                print(f"note: {note}", flush=True)
        finally:
            cleanup()
    text = report(a, todo, meas, merr, preds, perr, note, paired)
    print("\n" + text)
    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump({"command": shlex.join([sys.executable] + sys.argv), "date": started.isoformat(),
                       "measured": meas, "measure_errors": merr, "links": links, "predicted": preds, "predict_errors": perr},
                      f, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(f"# trn-plan's predictions against measured runs\n\n")
            f.write(f"{started:%Y-%m-%d %H:%M}, {cpu_model()}, {os.cpu_count()} CPUs, "
                    f"load average at the end {' '.join(open('/proc/loadavg').read().split()[:3])}\n\n")
            f.write(f"```\n{shlex.join([sys.executable] + sys.argv)}\n```\n\n")
            f.write(text + "\n")
            f.write("\nPer round (step s, peak RSS MB):\n\n")
            for l in todo:
                runs = ", ".join(f"{x[0]:.4f} / {x[1]:.0f}" for x in meas.get(l.label, []))
                f.write(f"- {l.label}: {runs or 'none'}\n")


if __name__ == "__main__":
    main()
