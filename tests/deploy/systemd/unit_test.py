#!/usr/bin/python3
"""Checks deploy/systemd/trn-coordinator.service with systemd's own tools and the real binary.

1. `systemd-analyze verify` accepts the unit (ExecStart pointed at the built binary) without a
   word, and reports a misspelt directive in a broken copy (so a typo cannot pass).
2. `systemd-analyze security --offline` rates its exposure at most THRESHOLD.
3. The hardening it must have is there (DynamicUser, StateDirectory, ProtectSystem=strict, ...).
4. Its ExecStart line, with %d and /var/lib/trn-coordinator pointed at temp folders, runs under
   strace while a trnrun job trains against it, metrics are scraped and it is stopped with
   SIGTERM; then every system call it made must be allowed by the unit's SystemCallFilter=,
   every socket family by RestrictAddressFamilies=, every /proc file by ProtectProc= (and
   ProcSubset=pid when the unit sets it), every /dev file by PrivateDevices=, and every write must land in its StateDirectory (ProtectSystem=
   strict). No systemd runs here as PID 1, so this is how the sandbox is exercised.

  unit_test.py SOURCE_DIR BIN_DIR
"""
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

THRESHOLD = 2.0  # systemd calls up to 2.0 "OK"; --threshold takes tenths
REQUIRED = {"DynamicUser": "yes", "StateDirectory": "trn-coordinator", "ProtectSystem": "strict",
            "NoNewPrivileges": "yes", "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateDevices": "yes",
            "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes", "MemoryDenyWriteExecute": "yes"}
STATE = "/var/lib/trn-coordinator"
CRED = "%d"
DEV_OK = re.compile(r"^/dev/(null|zero|full|random|urandom|tty|pts/.*|shm/.*|shm)$")
PROC_OK = re.compile(r"^/proc/(self|thread-self|\d+)(/|$)")


class Fail(Exception):
    pass


def directives(text):
    """[(key, value)] of the [Service] section, continuation lines joined."""
    out, section = [], None
    text = re.sub(r"\\\n\s*", " ", text)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            k, _, v = line.partition("=")
            out.append((k.strip(), v.strip()))
    return out


def expand_group(name, cache={}):
    """System calls of a systemd-analyze syscall-filter group, nested groups expanded."""
    if name not in cache:
        r = subprocess.run(["systemd-analyze", "syscall-filter", name], capture_output=True, text=True, check=True)
        calls = set()
        for line in r.stdout.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            if item.startswith("@"):
                calls |= expand_group(item)
            else:
                calls.add(item)
        cache[name] = calls
    return cache[name]


def allowed_syscalls(filters):
    allowed = set()
    for f in filters:
        deny = f.startswith("~")
        names = set()
        for item in f.lstrip("~").split():
            names |= expand_group(item) if item.startswith("@") else {item}
        allowed = allowed - names if deny else allowed | names
    return allowed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under_strace(exec_start, bindir, tmp):
    """Runs ExecStart (paths made local) under strace through a short job; returns the trace."""
    state, cred = os.path.join(tmp, "state"), os.path.join(tmp, "credentials")
    os.makedirs(state)
    os.makedirs(cred)
    with open(os.path.join(cred, "token"), "w") as f:
        f.write("0123456789abcdef0123456789abcdef\n")
    gport, mport = free_port(), free_port()
    argv = shlex.split(exec_start)
    argv[0] = os.path.join(bindir, "trn-coordinator")
    argv = [a.replace(STATE, state).replace(CRED, cred).replace("0.0.0.0:29400", f"127.0.0.1:{gport}")
            .replace("0.0.0.0:9400", f"127.0.0.1:{mport}") for a in argv]
    trace = os.path.join(tmp, "strace.out")
    log = open(os.path.join(tmp, "coordinator.log"), "wb")
    p = subprocess.Popen(["strace", "-f", "-qq", "-s", "512", "-o", trace] + argv, cwd="/",
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(200):
            if p.poll() is not None:
                raise Fail(f"the unit's ExecStart exited {p.returncode}: {open(log.name).read().strip()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise Fail("the unit's ExecStart did not serve metrics within 20 s")
        ckpt = os.path.join(tmp, "ckpt")
        os.mkdir(ckpt)
        job = subprocess.run([f"{bindir}/trnrun", "--coordinator", f"127.0.0.1:{gport}", "--job-id", "unit",
                              "--token-file", os.path.join(cred, "token"), "--nproc-per-node", "2", "--",
                              f"{bindir}/trn-train", "--dp", "2", "--steps", "10", "--checkpoint-dir", ckpt,
                              "--checkpoint-every", "5"], capture_output=True, text=True, timeout=120)
        if job.returncode != 0:
            raise Fail(f"a job against the unit's coordinator exited {job.returncode}:\n{job.stderr[-2000:]}")
        page = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        if 'trn_job_last_committed_step{job="unit"} 10' not in page:
            raise Fail("the job's checkpoint did not reach the unit's coordinator")
        os.killpg(p.pid, signal.SIGTERM)
        rc = p.wait(30)
        if rc != 0:
            raise Fail(f"the coordinator exited {rc} on SIGTERM (the unit expects 0)")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return open(trace, errors="replace").read(), state


def check_trace(trace, state, svc):
    problems = []
    filters = [v for k, v in svc if k == "SystemCallFilter" and v]
    allowed = allowed_syscalls(filters)
    families = set()
    for k, v in svc:
        if k == "RestrictAddressFamilies":
            families |= set(v.split())
    subset_pid = ("ProcSubset", "pid") in svc
    used = set()
    # The trace starts with strace's own execve of the binary, before the program runs.
    lines = trace.splitlines()
    for line in lines:
        m = re.match(r"^\d+\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()", line)
        if m:
            used.add(m.group(1) or m.group(2))
        for fam in re.findall(r"\bsocket(?:pair)?\((AF_\w+)", line):
            if fam not in families:
                problems.append(f"RestrictAddressFamilies= refuses {fam}: {line.strip()}")
        m = re.search(r'\bopenat\(AT_FDCWD, "([^"]+)", ([A-Z_|]+)', line)
        if m and "ENOENT" not in line:
            path, flags = m.groups()
            if path.startswith("/proc/") and not PROC_OK.match(path) and subset_pid:
                problems.append(f"ProcSubset=pid hides {path}")
            if path.startswith("/dev/") and not DEV_OK.match(path):
                problems.append(f"PrivateDevices= hides {path}")
            writes = any(f in flags for f in ("O_WRONLY", "O_RDWR", "O_CREAT"))
            if writes and not (path.startswith(state + "/") or path.startswith("/tmp/") or DEV_OK.match(path)):
                problems.append(f"ProtectSystem=strict makes {path} read-only ({flags})")
        m = re.search(r'\b(?:mkdir|mkdirat|rename|renameat2?|unlink|unlinkat)\((?:AT_FDCWD, )?"([^"]+)"', line)
        if m and not m.group(1).startswith((state, "/tmp/")):
            problems.append(f"ProtectSystem=strict refuses {line.strip()}")
    denied = sorted(used - allowed - {"execve"})
    if denied:
        problems.append(f"SystemCallFilter= would refuse (SIGSYS): {', '.join(denied)}")
    if len(used) < 20:
        problems.append(f"the trace shows only {len(used)} system calls; strace did not follow the coordinator")
    return problems, used


def main(src, bindir):
    unit_src = os.path.join(src, "deploy/systemd/trn-coordinator.service")
    for tool in ("systemd-analyze", "strace"):
        if not shutil.which(tool):
            raise Fail(f"{tool} is not installed (deploy/install-deps.sh installs systemd and strace)")
    tmp = tempfile.mkdtemp(prefix="trn-systemd-")
    try:
        text = open(unit_src).read()
        svc = directives(text)
        (exec_start,) = [v for k, v in svc if k == "ExecStart"]
        if shlex.split(exec_start)[0] != "/usr/local/bin/trn-coordinator":
            raise Fail(f"ExecStart runs {shlex.split(exec_start)[0]}, not /usr/local/bin/trn-coordinator")
        keys = dict(svc)
        for k, v in REQUIRED.items():
            if keys.get(k) != v:
                raise Fail(f"{k}={keys.get(k)}; the unit must say {k}={v}")
        if f"--state-dir {STATE}" not in exec_start:
            raise Fail(f"ExecStart does not keep its state in {STATE}")
        if f"--token-file {CRED}/token" not in exec_start or not keys.get("LoadCredential", "").startswith("token:"):
            raise Fail("the token is not passed as the credential 'token' (LoadCredential= and %d/token)")

        # systemd-analyze needs ExecStart's binary to exist: point it at the one just built.
        unit = os.path.join(tmp, "trn-coordinator.service")
        local = text.replace("/usr/local/bin/trn-coordinator", os.path.join(bindir, "trn-coordinator"))
        open(unit, "w").write(local)
        r = subprocess.run(["systemd-analyze", "verify", unit], capture_output=True, text=True, timeout=60)
        if r.returncode != 0 or (r.stdout + r.stderr).strip():
            raise Fail(f"systemd-analyze verify: exit {r.returncode}: {(r.stdout + r.stderr).strip()}")
        bad_dir = os.path.join(tmp, "bad")
        os.mkdir(bad_dir)
        bad = os.path.join(bad_dir, "trn-coordinator.service")
        open(bad, "w").write(local.replace("NoNewPrivileges=", "NoNewPrivilege="))
        r = subprocess.run(["systemd-analyze", "verify", bad], capture_output=True, text=True, timeout=60)
        if "NoNewPrivilege" not in r.stdout + r.stderr:
            raise Fail("systemd-analyze verify did not report a misspelt directive, so it checks nothing")
        r = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--threshold={int(THRESHOLD * 10)}", unit],
                           capture_output=True, text=True, timeout=60)
        score = re.search(r"Overall exposure level for \S+: ([\d.]+)", r.stdout)
        if r.returncode != 0 or not score:
            raise Fail(f"systemd-analyze security: exposure above {THRESHOLD} (exit {r.returncode}):\n{r.stdout[-1500:]}")

        trace, state = run_under_strace(exec_start, bindir, tmp)
        problems, used = check_trace(trace, state, svc)
        if problems:
            raise Fail("the coordinator does what its sandbox forbids:\n  " + "\n  ".join(sorted(set(problems))[:40]))
        print(f"unit_test: ok: verify clean, exposure {score.group(1)} (at most {THRESHOLD}), "
              f"{len(used)} system calls traced, all inside the unit's sandbox")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: unit_test.py SOURCE_DIR BIN_DIR", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    except Fail as e:
        print(f"unit_test: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
