#!/usr/bin/python3
"""A real Prometheus scraping a real trn-coordinator, with deploy/prometheus's rules loaded.

Starts trn-coordinator (metrics on a free port) and Prometheus (the scrape job of
deploy/prometheus/prometheus.yml pointed at it, 1 s scrapes, trn-alerts.yml loaded), runs a
short trnrun job that commits checkpoints and one whose worker fails, then checks through
Prometheus's HTTP API that: every trn_ metric family the coordinator serves was ingested; the
job's series carry the values the job produced; every alert rule loaded and evaluates without
error; TrnJobFailed fires for the failed job and for no other; each query of the Grafana
dashboard parses and names only metrics the coordinator serves. Everything started is stopped
and the temp dir removed on any exit.

  live_test.py SOURCE_DIR BIN_DIR
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

DEADLINE = time.monotonic() + 200  # well inside the ctest timeout, so cleanup always runs


class Fail(Exception):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, fn, seconds):
    end = min(time.monotonic() + seconds, DEADLINE)
    last = None
    while time.monotonic() < end:
        try:
            v = fn()
            if v:
                return v
        except Fail:
            raise
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.2)
    raise Fail(f"{what} within {seconds} s" + (f" (last error: {last})" if last else ""))


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path, **params):
        body = json.loads(http_get(f"{self.base}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
        if body.get("status") != "success":
            raise Fail(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def value(self, expr):
        r = self.query(expr)
        if len(r) != 1:
            raise Fail(f"{expr}: expected one series, got {r}")
        return float(r[0]["value"][1])


def exported_names(page):
    """Series names a /metrics page declares (a histogram's are its _bucket, _sum and _count)."""
    names = set()
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", page, re.M):
        name, kind = m.groups()
        names |= {name + "_bucket", name + "_sum", name + "_count"} if kind == "histogram" else {name}
    return names


def referenced_names(expr):
    return set(re.findall(r"\btrn_[a-z0-9_]+", expr))


def main(src, bindir):
    procs = []
    tmp = tempfile.mkdtemp(prefix="trn-prom-")

    def start(name, argv, **kw):
        log = open(os.path.join(tmp, name + ".log"), "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        procs.append((name, p))
        return p

    def stop_all():
        for name, p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        end = time.monotonic() + 10
        for name, p in reversed(procs):
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def logs():
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".log"):
                with open(os.path.join(tmp, f), errors="replace") as fh:
                    print(f"---- {f} (last lines)\n" + "".join(fh.readlines()[-15:]), file=sys.stderr)

    try:
        for tool in ("prometheus", "promtool"):
            if not shutil.which(tool):
                raise Fail(f"{tool} is not installed (deploy/install-deps.sh installs prometheus)")
        metrics_port, prom_port = free_port(), free_port()
        port_file = os.path.join(tmp, "coordinator.port")
        coord = start("coordinator", [f"{bindir}/trn-coordinator", "--listen", "127.0.0.1:0",
                                      "--port-file", port_file, "--state-dir", os.path.join(tmp, "state"),
                                      "--metrics-listen", f"127.0.0.1:{metrics_port}"])
        wait_for("trn-coordinator wrote its port file",
                 lambda: coord.poll() is None and os.path.getsize(port_file) > 0, 20)
        address = "127.0.0.1:" + open(port_file).read().strip()

        # The shipped scrape job and rules, pointed at this coordinator, scraped every second.
        with open(os.path.join(src, "deploy/prometheus/prometheus.yml")) as f:
            cfg = yaml.safe_load(f)
        cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
        cfg["rule_files"] = [os.path.join(src, "deploy/prometheus", r) for r in cfg["rule_files"]]
        (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "trn-coordinator"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
        prom_cfg = os.path.join(tmp, "prometheus.yml")
        with open(prom_cfg, "w") as f:
            yaml.safe_dump(cfg, f)
        subprocess.run(["promtool", "check", "config", prom_cfg], check=True, stdout=subprocess.DEVNULL)
        start("prometheus", ["prometheus", f"--config.file={prom_cfg}",
                             f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"])
        prom = Prom(prom_port)
        wait_for("prometheus became ready", lambda: http_get(prom.base + "/-/ready").strip() != "", 30)
        wait_for("prometheus scraped the coordinator (up == 1)",
                 lambda: [r for r in prom.query('up{job="trn-coordinator"}') if r["value"][1] == "1"], 30)

        # A job that commits checkpoints, long enough for several scrapes while it runs.
        os.mkdir(os.path.join(tmp, "ckpt"))
        t0 = time.time()
        trnrun = [f"{bindir}/trnrun", "--coordinator", address, "--nproc-per-node", "1"]
        job_run = start("job-live", trnrun + ["--job-id", "prom-live", "--", f"{bindir}/trn-train",
                                             "--model", "tiny", "--steps", "240", "--log-every", "60",
                                             "--checkpoint-dir", os.path.join(tmp, "ckpt"),
                                             "--checkpoint-every", "60",
                                             # raw bytes for the validation gauge
                                             "--val-data", "/usr/share/common-licenses/GPL-3",
                                             "--eval-every", "60"])
        def running_age():
            if job_run.poll() is not None:
                raise Fail(f"the trnrun job exited {job_run.returncode} before a scrape saw it running")
            return prom.query('trn_job_heartbeat_age_seconds{job="prom-live"}')

        age = wait_for("prometheus ingested trn_job_heartbeat_age_seconds of the running job", running_age, 60)
        age = float(age[0]["value"][1])
        if not 0 <= age < 3:
            raise Fail(f"heartbeat age of a healthy running job is {age} s")
        try:
            rc = job_run.wait(max(1, DEADLINE - time.monotonic() - 30))
        except subprocess.TimeoutExpired:
            raise Fail("the trnrun job did not finish")
        if rc != 0:
            raise Fail(f"the trnrun job exited {rc}")
        t1 = time.time()
        # A mixture-of-experts job: rank 0's MoE figures per job and layer (trn_job_moe_*), long
        # enough for heartbeats (1 s apart) to carry them while it runs and a scrape (1 s apart) to
        # see them: 600 steps of mixtral-tiny take about 5 s on a free core (60 took 1.2 s, which
        # a scrape could miss).
        moe_run = start("job-moe", trnrun + ["--job-id", "prom-moe", "--", f"{bindir}/trn-train",
                                             "--model", "mixtral-tiny", "--steps", "600", "--log-every", "200"])
        def moe_ingested():
            got = prom.query('trn_job_moe_dropped{job="prom-moe"}')
            if not got and moe_run.poll() is not None:
                raise Fail(f"the MoE job exited {moe_run.returncode} before a scrape saw its MoE gauges")
            return got
        wait_for("prometheus ingested prom-moe's MoE gauges", moe_ingested, 60)
        if moe_run.wait(max(1, DEADLINE - time.monotonic() - 30)) != 0:
            raise Fail(f"the MoE job exited {moe_run.returncode}")
        # A job whose worker fails with a usage error: the coordinator marks it failed.
        fail_run = start("job-fail", trnrun + ["--job-id", "prom-fail", "--", f"{bindir}/trn-train", "--steps", "0"])
        if fail_run.wait(60) != 2:
            raise Fail("the failing job did not exit 2")

        wait_for("prometheus saw prom-live completed",
                 lambda: prom.query('trn_job_generation{job="prom-live",state="completed"}'), 20)
        wait_for("prometheus saw prom-moe completed",
                 lambda: prom.query('trn_job_generation{job="prom-moe",state="completed"}'), 20)
        wait_for("prometheus saw prom-fail failed",
                 lambda: prom.query('trn_job_generation{job="prom-fail",state="failed"}'), 20)
        page = http_get(f"http://127.0.0.1:{metrics_port}/metrics")
        names = exported_names(page)
        ingested = set(prom.api("label/__name__/values", start=t0 - 60, end=time.time(),
                                **{"match[]": '{__name__=~"trn_.+"}'}))
        if names - ingested:
            raise Fail(f"served but not ingested: {sorted(names - ingested)}")
        checks = {
            'trn_job_last_committed_step{job="prom-live"}': lambda v: v == 240,
            'trn_job_last_committed_timestamp_seconds{job="prom-live"}': lambda v: t0 - 1 <= v <= t1 + 1,
            'trn_job_members{job="prom-live"}': lambda v: v == 1,
            'trn_job_val_loss{job="prom-live"}': lambda v: 0 < v < 10,
            'trn_job_restarts_total{job="prom-live"}': lambda v: v == 0,
            'trn_job_last_committed_step{job="prom-fail"}': lambda v: v == -1,
            # mixtral-tiny: 2 MoE layers of 4 experts; a dense job has no MoE series.
            'trn_job_moe_aux_loss{job="prom-moe"}': lambda v: v > 0,
            'count(trn_job_moe_max_mean{job="prom-moe"})': lambda v: v == 2,
            'min(trn_job_moe_max_mean{job="prom-moe"})': lambda v: 1 <= v <= 4,
            'count(trn_job_moe_dead_experts{job="prom-moe"})': lambda v: v == 2,
            'max(trn_job_moe_dead_experts{job="prom-moe"})': lambda v: 0 <= v < 4,
            'trn_job_moe_dropped{job="prom-moe"}': lambda v: v >= 0,
            'count(trn_job_moe_aux_loss{job="prom-live"}) or vector(0)': lambda v: v == 0,
            "trn_coordinator_jobs": lambda v: v == 3,
            "trn_coordinator_heartbeat_timeout_seconds": lambda v: v == 30,
            "trn_coordinator_heartbeats_total": lambda v: v > 0,
            'sum(trn_coordinator_rpcs_total{method="Join",code="OK"})': lambda v: v == 3,
            # trnrun's node heartbeats come as datagrams (gRPC only when one goes unanswered).
            'sum(trn_coordinator_rpc_seconds_count{method=~"Heartbeat|HeartbeatDatagram"})': lambda v: v > 0,
            'sum(trn_coordinator_rpcs_total{method="HeartbeatDatagram",code="OK"})': lambda v: v > 0,
        }
        for expr, ok in checks.items():
            v = prom.value(expr)
            if not ok(v):
                raise Fail(f"{expr} is {v}")

        # Every rule of trn-alerts.yml is loaded and evaluates cleanly against live data.
        with open(os.path.join(src, "deploy/prometheus/trn-alerts.yml")) as f:
            rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
        for r in rules:
            unknown = referenced_names(r["expr"]) - names
            if unknown:
                raise Fail(f"alert {r['alert']} uses metrics the coordinator does not serve: {sorted(unknown)}")

        def rules_evaluated():
            loaded = {r["name"]: r for g in prom.api("rules")["groups"] for r in g["rules"]}
            missing = {r["alert"] for r in rules} - set(loaded)
            if missing:
                raise Fail(f"prometheus did not load {sorted(missing)}")
            bad = {n: r.get("lastError") for n, r in loaded.items() if r["health"] not in ("ok", "unknown")}
            if bad:
                raise Fail(f"rules evaluate with errors: {bad}")
            return all(r["health"] == "ok" for r in loaded.values())

        wait_for("every rule was evaluated", rules_evaluated, 15)

        def failed_alerts():
            alerts = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
            return [a for a in alerts if a["labels"]["alertname"] == "TrnJobFailed"] and alerts

        firing = wait_for("TrnJobFailed fired", failed_alerts, 15)
        got = sorted((a["labels"]["alertname"], a["labels"].get("job")) for a in firing)
        if got != [("TrnJobFailed", "prom-fail")]:
            raise Fail(f"firing alerts: {got}; expected only TrnJobFailed for prom-fail")

        # The Grafana dashboard: valid JSON whose every query parses and names served metrics.
        with open(os.path.join(src, "deploy/grafana/trn.json")) as f:
            dash = json.load(f)
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        if len(exprs) < 10:
            raise Fail(f"the dashboard has {len(exprs)} queries")
        for e in exprs:
            unknown = referenced_names(e) - names - {"up"}
            if unknown:
                raise Fail(f"dashboard query {e!r} uses metrics the coordinator does not serve: {sorted(unknown)}")
            q = e.replace("$__rate_interval", "1m").replace("$job", ".*")
            if "$" in q:
                raise Fail(f"dashboard query {e!r} uses a variable this test does not know")
            prom.query(q)  # raises on a parse error
        var = {v["name"]: v for v in dash["templating"]["list"]}["job"]
        m = re.fullmatch(r"label_values\((\w+), (\w+)\)", var["definition"])
        if not m or m.group(1) not in names:
            raise Fail(f"dashboard variable job: {var['definition']}")
        jobs = {r["metric"]["job"] for r in prom.query(m.group(1))}
        if jobs != {"prom-live", "prom-moe", "prom-fail"}:
            raise Fail(f"dashboard variable job would list {sorted(jobs)}")
        print(f"live_test: ok: {len(ingested)} trn_ metric families ingested, {len(rules)} rules evaluated, "
              f"TrnJobFailed fired, {len(exprs)} dashboard queries parsed")
        return 0
    except (Fail, subprocess.CalledProcessError) as e:
        print(f"live_test: FAIL: {e}", file=sys.stderr)
        logs()
        return 1
    finally:
        stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: live_test.py SOURCE_DIR BIN_DIR", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # ctest's timeout: clean up on the way out
    sys.exit(main(sys.argv[1], sys.argv[2]))
