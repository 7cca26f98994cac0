#!/usr/bin/python3
"""Offline checks of deploy/kubernetes, with no cluster.

1. Schema: every object is walked against the Kubernetes API types of Debian's
   python3-kubernetes (its generated models: field names, types, required fields). Fields newer
   than that client (v22, Kubernetes 1.22) are checked against the shapes written in NEWER below.
2. Wiring: the names and numbers that must agree across objects (Services and selectors,
   Secret, volumes and mounts, probes and ports, --nnodes and the Job's completions, the layout
   and the worker count, the completion index as node rank).
3. Flags: the coordinator's and trnrun's argument lists are run through the real binaries
   (trn-coordinator starts and answers on its metrics port; trnrun --dry-run accepts its own).

  check_manifests.py SOURCE_DIR BIN_DIR     check deploy/kubernetes
  check_manifests.py --self-test SOURCE_DIR BIN_DIR
                                            also break copies of the manifests on purpose and
                                            require each break to be reported
"""
import copy
import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

try:
    import kubernetes.client as k8s
except ImportError:
    print("check_manifests: python3-kubernetes is not installed (deploy/install-deps.sh installs it)", file=sys.stderr)
    sys.exit(1)

KINDS = {("v1", "Service"): "V1Service", ("v1", "Secret"): "V1Secret",
         ("apps/v1", "StatefulSet"): "V1StatefulSet", ("batch/v1", "Job"): "V1Job",
         ("kustomize.config.k8s.io/v1beta1", "Kustomization"): None}

# Fields the client's models predate: (model, field) -> {field: type} of the new field's value.
NEWER = {
    ("V1Probe", "grpc"): {"port": "int", "service": "str"},  # Kubernetes 1.24
    ("V1JobSpec", "podFailurePolicy"): "PodFailurePolicy",  # 1.26
}
NEWER_TYPES = {
    "PodFailurePolicy": {"rules": "list[PodFailurePolicyRule]"},
    "PodFailurePolicyRule": {"action": "str", "onExitCodes": "PodFailurePolicyOnExitCodes",
                             "onPodConditions": "list[PodFailurePolicyOnPodCondition]"},
    "PodFailurePolicyOnExitCodes": {"containerName": "str", "operator": "str", "values": "list[int]"},
    "PodFailurePolicyOnPodCondition": {"type": "str", "status": "str"},
}
NEWER_REQUIRED = {"grpc": {"port"}, "PodFailurePolicy": {"rules"}, "PodFailurePolicyRule": {"action"},
                  "PodFailurePolicyOnExitCodes": {"operator", "values"}, "PodFailurePolicyOnPodCondition": {"type"}}


def required_fields(cls):
    """Fields a generated model refuses to be None (its setter raises)."""
    req = set()
    for attr in cls.openapi_types:
        prop = getattr(cls, attr, None)
        if isinstance(prop, property) and "must not be `None`" in inspect.getsource(prop.fset):
            req.add(cls.attribute_map[attr])
    return req


def check_value(value, typ, path, errors):
    if typ.startswith("list["):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list")
            return
        for i, v in enumerate(value):
            check_value(v, typ[5:-1], f"{path}[{i}]", errors)
    elif typ.startswith("dict("):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map")
            return
        inner = typ[5:-1].split(", ", 1)[1]
        for key, v in value.items():
            check_value(v, inner, f"{path}.{key}", errors)
    elif typ == "str":
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
    elif typ == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: expected an integer, got {value!r}")
    elif typ == "bool":
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true or false, got {value!r}")
    elif typ == "object":  # IntOrString, Quantity
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            errors.append(f"{path}: expected a string or a number, got {value!r}")
    elif typ == "datetime":
        if not isinstance(value, str):
            errors.append(f"{path}: expected a timestamp")
    elif typ in NEWER_TYPES:
        check_fields(value, NEWER_TYPES[typ], NEWER_REQUIRED.get(typ, set()), path, errors)
    else:
        check_model(value, getattr(k8s, typ), path, errors)


def check_fields(obj, fields, required, path, errors):
    if not isinstance(obj, dict):
        errors.append(f"{path}: expected an object")
        return
    for key, v in obj.items():
        if key not in fields:
            errors.append(f"{path}.{key}: no such field")
        else:
            check_value(v, fields[key], f"{path}.{key}", errors)
    for key in sorted(required - set(obj)):
        errors.append(f"{path}.{key}: required field missing")


def check_model(obj, cls, path, errors):
    if not isinstance(obj, dict):
        errors.append(f"{path}: expected an object ({cls.__name__})")
        return
    fields = {cls.attribute_map[a]: t for a, t in cls.openapi_types.items()}
    required = required_fields(cls)
    for (model, field), typ in NEWER.items():
        if model == cls.__name__ and field in obj:
            if isinstance(typ, dict):
                check_fields(obj[field], typ, NEWER_REQUIRED.get(field, set()), f"{path}.{field}", errors)
            else:
                check_value(obj[field], typ, f"{path}.{field}", errors)
            obj = {k: v for k, v in obj.items() if k != field}
    check_fields(obj, fields, required, path, errors)


def load(kdir):
    """(file, document) pairs of every YAML file in kdir."""
    docs = []
    for name in sorted(os.listdir(kdir)):
        if name.endswith((".yaml", ".yml")):
            with open(os.path.join(kdir, name)) as f:
                docs += [(name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def flag(args, name):
    """The value of --name=V or --name V in an argument list (None when absent)."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def check_wiring(docs, errors):
    by = {}
    for name, d in docs:
        by.setdefault((d.get("kind"), (d.get("metadata") or {}).get("name")), []).append((name, d))
    for key, v in by.items():
        if len(v) > 1 and key[0] != "Kustomization":
            errors.append(f"{key[0]} {key[1]} is defined {len(v)} times")
    get = lambda kind, name: (by.get((kind, name)) or [(None, None)])[0][1]

    kust = get("Kustomization", None)
    files = {n for n, d in docs if d.get("kind") != "Kustomization"}
    if kust is None:
        errors.append("kustomization.yaml is missing")
    else:
        listed = set(kust.get("resources", []))
        for f in sorted(listed - files):
            errors.append(f"kustomization lists {f}, which does not exist")
        for f in sorted(files - listed - {"secret.yaml"}):
            errors.append(f"kustomization leaves out {f}")

    sts, svc = get("StatefulSet", "trn-coordinator"), get("Service", "trn-coordinator")
    job, headless = get("Job", "trn-train"), get("Service", "trn-workers")
    for what, obj in (("StatefulSet trn-coordinator", sts), ("Service trn-coordinator", svc),
                      ("Job trn-train", job), ("Service trn-workers", headless), ("Secret trn-token", get("Secret", "trn-token"))):
        if obj is None:
            errors.append(f"{what} is missing")
    if errors:
        return None

    def pod_of(obj):
        return obj["spec"]["template"]

    def selects(service, pod_labels, what):
        sel = service["spec"].get("selector") or {}
        if not sel or any(pod_labels.get(k) != v for k, v in sel.items()):
            errors.append(f"Service {service['metadata']['name']} selector {sel} does not select the {what} pods")

    def mounts_and_volumes(pod, cname):
        spec = pod["spec"]
        (c,) = [c for c in spec["containers"] if c["name"] == cname] or [None]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        return c, vols

    # Coordinator.
    cpod = pod_of(sts)
    if sts["spec"].get("replicas") != 1:
        errors.append("the coordinator StatefulSet must have exactly 1 replica")
    if sts["spec"]["serviceName"] != svc["metadata"]["name"]:
        errors.append(f"StatefulSet serviceName {sts['spec']['serviceName']} is not Service trn-coordinator")
    if any(cpod["metadata"]["labels"].get(k) != v for k, v in sts["spec"]["selector"]["matchLabels"].items()):
        errors.append("the StatefulSet's selector does not match its pod labels")
    selects(svc, cpod["metadata"]["labels"], "coordinator")
    c, vols = mounts_and_volumes(cpod, "coordinator")
    if c is None:
        errors.append("the coordinator pod has no container named coordinator")
        return None
    cargs = c.get("command", []) + c.get("args", [])
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    listen, metrics = flag(cargs, "--listen"), flag(cargs, "--metrics-listen")
    if not listen or int(listen.rsplit(":", 1)[1]) != ports.get("grpc"):
        errors.append(f"--listen {listen} is not the grpc container port {ports.get('grpc')}")
    if not metrics or int(metrics.rsplit(":", 1)[1]) != ports.get("metrics"):
        errors.append(f"--metrics-listen {metrics} is not the metrics container port {ports.get('metrics')}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p or "grpc" not in p:
            errors.append(f"the coordinator has no gRPC {probe}")
        elif p["grpc"]["port"] != ports.get("grpc"):
            errors.append(f"{probe} checks port {p['grpc']['port']}, not the gRPC port")
    for sp in svc["spec"]["ports"]:
        if sp["targetPort"] not in ports:
            errors.append(f"Service port {sp['name']} targets {sp['targetPort']}, which the container does not name")
    # Node heartbeat datagrams go to the gRPC port number over UDP (launcher/server/datagram_server.h).
    udp = [p for p in c.get("ports", []) if p.get("protocol") == "UDP"]
    if "--no-heartbeat-datagrams" not in cargs:
        if [p["containerPort"] for p in udp] != [ports.get("grpc")]:
            errors.append(f"the coordinator takes heartbeat datagrams on UDP {ports.get('grpc')}, but its UDP "
                          f"container ports are {[p['containerPort'] for p in udp]}")
        svc_udp = [sp for sp in svc["spec"]["ports"] if sp.get("protocol") == "UDP"]
        grpc_svc = [sp["port"] for sp in svc["spec"]["ports"] if sp["name"] == "grpc"]
        if [sp["port"] for sp in svc_udp] != grpc_svc:
            errors.append("the Service has no UDP port at the gRPC port's number for heartbeat datagrams "
                          "(trnrun sends them to the port number the coordinator bound)")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    if mounts.get(flag(cargs, "--state-dir")) not in claims:
        errors.append(f"--state-dir {flag(cargs, '--state-dir')} is not a mount of a volumeClaimTemplate")

    def token_ok(container, vols, args, who):
        tf = flag(args, "--token-file")
        d, f = os.path.split(tf or "")
        vol = vols.get(next((m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == d), None))
        if not vol or (vol.get("secret") or {}).get("secretName") != "trn-token" or \
                f not in [i["path"] for i in vol["secret"].get("items", [])]:
            errors.append(f"{who}'s --token-file {tf} is not the trn-token Secret's mounted key")

    token_ok(c, vols, cargs, "the coordinator")

    # Workers.
    spec, wpod = job["spec"], pod_of(job)
    if spec.get("completionMode") != "Indexed":
        errors.append("the worker Job must have completionMode: Indexed")
    if headless["spec"].get("clusterIP") != "None":
        errors.append("Service trn-workers must be headless (clusterIP: None)")
    if wpod["spec"].get("subdomain") != headless["metadata"]["name"]:
        errors.append("the worker pods' subdomain is not the headless Service")
    selects(headless, wpod["metadata"]["labels"], "worker")
    w, wvols = mounts_and_volumes(wpod, "trnrun")
    if w is None:
        errors.append("the worker pod has no container named trnrun")
        return None
    wargs = w.get("command", []) + w.get("args", [])
    env = {e["name"]: e for e in w.get("env", [])}
    nnodes = flag(wargs, "--nnodes")
    if nnodes is None or not (int(nnodes) == spec.get("completions") == spec.get("parallelism")):
        errors.append(f"--nnodes {nnodes}, completions {spec.get('completions')} and parallelism "
                      f"{spec.get('parallelism')} must agree")
    rank = flag(wargs, "--node-rank")
    ref = re.fullmatch(r"\$\((\w+)\)", rank or "")
    path = ((env.get(ref.group(1)) or {}).get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") if ref else None
    if path != "metadata.annotations['batch.kubernetes.io/job-completion-index']":
        errors.append(f"--node-rank {rank} is not the pod's completion index")
    coord = flag(wargs, "--coordinator") or ""
    if coord != f"{svc['metadata']['name']}:{[p['port'] for p in svc['spec']['ports'] if p['name'] == 'grpc'][0]}":
        errors.append(f"--coordinator {coord} is not Service trn-coordinator's grpc port")
    token_ok(w, wvols, wargs, "trnrun")
    train = wargs[wargs.index("--") + 1:] if "--" in wargs else []
    if not train or train[0] != "trn-train":
        errors.append("trnrun does not start trn-train")
    else:
        layout = 1
        for f in ("--dp", "--tp", "--pp"):
            layout *= int(flag(train, f) or 1)
        workers = int(nnodes or 0) * int(flag(wargs, "--nproc-per-node") or 1)
        if layout != workers:
            errors.append(f"--dp x --tp x --pp is {layout}, but the job has {workers} workers")
    for e, obj in (("coordinator", c), ("trnrun", w)):
        for var in re.findall(r"\$\((\w+)\)", " ".join(obj.get("command", []) + obj.get("args", []))):
            if var not in {x["name"] for x in obj.get("env", [])}:
                errors.append(f"the {e} arguments use $({var}), which its env does not define")
    return {"coordinator": cargs, "trnrun": wargs, "mounts": mounts}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_flags(found, bindir, errors):
    """Runs the manifests' argument lists through the real binaries."""
    tmp = tempfile.mkdtemp(prefix="trn-k8s-")
    try:
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write("0123456789abcdef\n")
        gport, mport = free_port(), free_port()
        subst = {"/etc/trn/token": token, "/var/lib/trn-coordinator": os.path.join(tmp, "state")}
        os.mkdir(subst["/var/lib/trn-coordinator"])

        def local(a):
            for k, v in subst.items():
                a = a.replace(k, v)
            return a.replace("0.0.0.0:29400", f"127.0.0.1:{gport}").replace("0.0.0.0:9400", f"127.0.0.1:{mport}")

        cargs = [local(a) for a in found["coordinator"]]
        p = subprocess.Popen([os.path.join(bindir, cargs[0])] + cargs[1:], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            up = False
            for _ in range(100):
                if p.poll() is not None:
                    break
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2).read()
                    up = True
                    break
                except OSError:
                    time.sleep(0.1)
            if not up:
                errors.append(f"trn-coordinator with the StatefulSet's arguments did not serve metrics: "
                              f"{(p.stdout.read1() if p.poll() is not None else b'').decode(errors='replace').strip()}")
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p.returncode not in (0, None) and up:
            errors.append(f"trn-coordinator exited {p.returncode} on SIGTERM")

        wargs = [local(a).replace("$(JOB_COMPLETION_INDEX)", "1").replace("$(JOB_UID)", "0b6c1c5e") for a in found["trnrun"]]
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
        r = subprocess.run([os.path.join(bindir, wargs[0]), "--dry-run"] + wargs[1:], env=env,
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            errors.append(f"trnrun --dry-run with the Job's arguments failed: {(r.stderr or r.stdout).strip()}")
        elif "rank 1" not in r.stdout:
            errors.append(f"trnrun --dry-run did not take node rank 1 from the completion index:\n{r.stdout}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check(docs, bindir):
    errors = []
    for name, d in docs:
        key = (d.get("apiVersion"), d.get("kind"))
        where = f"{name}: {d.get('kind')} {(d.get('metadata') or {}).get('name', '')}".rstrip()
        if key not in KINDS:
            errors.append(f"{where}: unexpected apiVersion/kind {key}")
        elif KINDS[key]:
            check_model(d, getattr(k8s, KINDS[key]), where, errors)
    if errors:
        return errors
    found = check_wiring(docs, errors)
    if found and not errors and bindir:
        check_flags(found, bindir, errors)
    return errors


def self_test(docs):
    """Each break must be reported; returns the breaks that were not."""
    def edit(kind, fn):
        def apply(ds):
            for _, d in ds:
                if d.get("kind") == kind:
                    fn(d)
            return ds
        return apply

    c0 = lambda d: d["spec"]["template"]["spec"]["containers"][0]
    breaks = {
        "a misspelt field": edit("StatefulSet", lambda d: d["spec"].__setitem__("replica", 1)),
        "a missing required field": edit("Job", lambda d: c0(d).pop("name")),
        "a string where a number goes": edit("Job", lambda d: d["spec"].__setitem__("completions", "2")),
        "a misspelt field inside grpc": edit("StatefulSet", lambda d: c0(d)["livenessProbe"]["grpc"].__setitem__("prot", 1)),
        "a probe on the wrong port": edit("StatefulSet", lambda d: c0(d)["readinessProbe"]["grpc"].__setitem__("port", 9400)),
        "completions unlike --nnodes": edit("Job", lambda d: d["spec"].__setitem__("completions", 3)),
        "a layout unlike the worker count": edit("Job", lambda d: c0(d)["args"].__setitem__(-1, "2")),
        "a node rank not from the index": edit("Job", lambda d: c0(d)["args"].__setitem__(3, "0")),
        "a non-indexed Job": edit("Job", lambda d: d["spec"].__setitem__("completionMode", "NonIndexed")),
        "state not on the claim": edit("StatefulSet", lambda d: c0(d)["args"].__setitem__(3, "/data")),
        "a coordinator flag that does not exist": edit("StatefulSet", lambda d: c0(d)["args"].extend(["--heartbeat-timout", "30"])),
        "a trnrun flag that does not exist": edit("Job", lambda d: c0(d)["args"].insert(0, "--max-restart=3")),
    }
    missed = []
    for what, brk in breaks.items():
        if not check(brk(copy.deepcopy(docs)), BINDIR):
            missed.append(what)
    return missed


BINDIR = None


def main(argv):
    global BINDIR
    selftest = argv[:1] == ["--self-test"]
    if selftest:
        argv = argv[1:]
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-6], file=sys.stderr)
        return 2
    src, BINDIR = argv
    docs = load(os.path.join(src, "deploy/kubernetes"))
    errors = check(docs, BINDIR)
    for e in errors:
        print(f"check_manifests: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"check_manifests: ok: {len(docs)} objects match the API schema, agree with each other, "
          f"and their flags are accepted by trn-coordinator and trnrun")
    if selftest:
        missed = self_test(docs)
        if missed:
            print(f"check_manifests: FAIL: the checks missed: {', '.join(missed)}", file=sys.stderr)
            return 1
        print("check_manifests: ok: every deliberate break was reported")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
