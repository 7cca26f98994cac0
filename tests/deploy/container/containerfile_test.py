#!/usr/bin/python3
"""Offline checks of deploy/container/Containerfile (no image is built here: see deploy/README.md).

- Two stages, both FROM Debian 12 images; the build stage runs deploy/install-deps.sh --build.
- Every path the build stage COPYs exists in the source tree.
- Every package deploy/install-deps.sh installs (all of them, and the --build ones) and every
  package the runtime stage installs is a real Debian package here (`apt-cache show`), and the
  runtime stage installs no -dev package.
- The programs the build stage builds are the ones the runtime stage copies, each was built by
  this tree's build, and the runtime stage installs the Debian package of every shared library
  each of them links (their DT_NEEDED entries, resolved with ldconfig and dpkg -S), apart from
  libc6 and libgcc-s1, which every Debian image has.

  containerfile_test.py SOURCE_DIR BIN_DIR
"""
import os
import re
import shlex
import subprocess
import sys

BASE_PACKAGES = {"libc6", "libgcc-s1"}


class Fail(Exception):
    pass


def instructions(path):
    """[(INSTRUCTION, argument text)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in open(path):
        s = line.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    if cur:
        raise Fail(f"{path}: the last instruction ends with a line continuation")
    return out


def stages(instrs):
    args, result = {}, []
    for ins, rest in instrs:
        if ins == "ARG" and not result:
            k, _, v = rest.partition("=")
            args[k] = v
        elif ins == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0])
            name = rest.split()[2] if len(rest.split()) == 3 and rest.split()[1].upper() == "AS" else None
            result.append({"image": image, "name": name, "instrs": []})
        elif result:
            result[-1]["instrs"].append((ins, rest))
        else:
            raise Fail(f"{ins} before the first FROM")
    return result


def apt_installs(run):
    """Package names after `apt-get install` in a RUN line."""
    pkgs = []
    for cmd in re.split(r"&&|;", run):
        words = shlex.split(cmd)
        if "apt-get" in words and "install" in words:
            pkgs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return pkgs


def debian_packages(names):
    """The names among names that the Debian archive here has (one apt-cache call)."""
    r = subprocess.run(["apt-cache", "show", "--no-all-versions"] + list(names), capture_output=True, text=True)
    return set(re.findall(r"^Package: (\S+)$", r.stdout, re.M))


def needed_packages(binaries):
    """{binary: {library: Debian package}} for the shared libraries each binary links directly."""
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout
    needed = {}
    for binary in binaries:
        dyn = subprocess.run(["objdump", "-p", binary], capture_output=True, text=True, check=True).stdout
        needed[binary] = {}
        for lib in re.findall(r"^\s*NEEDED\s+(\S+)$", dyn, re.M):
            m = re.search(rf"^\s*{re.escape(lib)} \(libc6,x86-64[^)]*\) => (\S+)$", cache, re.M) or \
                re.search(rf"^\s*{re.escape(lib)} \([^)]*\) => (\S+)$", cache, re.M)
            if not m:
                raise Fail(f"{binary} links {lib}, which ldconfig does not know")
            real = os.path.realpath(m.group(1))
            # dpkg knows a file by the path its package ships it at: /lib or /usr/lib (merged /usr).
            needed[binary][lib] = [p for q in (real, m.group(1)) for p in (q, re.sub(r"^/usr/lib/", "/lib/", q))]
    paths = sorted({p for libs in needed.values() for ps in libs.values() for p in ps})
    r = subprocess.run(["dpkg", "-S"] + paths, capture_output=True, text=True)
    owner = {}
    for line in r.stdout.splitlines():
        pkg, _, path = line.partition(": ")
        owner[path] = pkg.split(":")[0]
    for binary, libs in needed.items():
        for lib, ps in libs.items():
            found = [owner[p] for p in ps if p in owner]
            if not found:
                raise Fail(f"{binary} links {lib} ({ps[0]}), which no Debian package owns")
            libs[lib] = found[0]
    return needed


def main(src, bindir):
    cf = os.path.join(src, "deploy/container/Containerfile")
    st = stages(instructions(cf))
    if len(st) != 2:
        raise Fail(f"expected a build and a runtime stage, found {len(st)}")
    build, runtime = st
    for s in st:
        if not re.fullmatch(r"debian:12(-slim)?", s["image"]):
            raise Fail(f"stage {s['name']} starts FROM {s['image']}, not a Debian 12 image")
    runs = lambda s: [r for i, r in s["instrs"] if i == "RUN"]
    if not any("deploy/install-deps.sh --build" in r for r in runs(build)):
        raise Fail("the build stage does not run deploy/install-deps.sh --build")

    # Build stage: sources exist.
    workdir = "/"
    for ins, rest in build["instrs"]:
        if ins == "WORKDIR":
            workdir = rest
        if ins == "COPY":
            parts = shlex.split(rest)
            if any(p.startswith("--from") for p in parts):
                raise Fail("the build stage copies from another stage")
            for p in parts[:-1]:
                if not os.path.exists(os.path.join(src, p)):
                    raise Fail(f"the build stage copies {p}, which is not in the source tree")

    # Packages exist.
    deps = lambda *a: subprocess.run([os.path.join(src, "deploy/install-deps.sh"), "--list", *a],
                                     capture_output=True, text=True, check=True).stdout.split()
    listed, every = deps("--build"), deps()
    if not set(listed) <= set(every):
        raise Fail("install-deps.sh --build lists packages that plain install-deps.sh does not install")
    runtime_pkgs = [p for r in runs(runtime) for p in apt_installs(r)]
    if not runtime_pkgs:
        raise Fail("the runtime stage installs no packages")
    known = debian_packages(every + runtime_pkgs)
    unknown = [p for p in every + runtime_pkgs if p not in known]
    if unknown:
        raise Fail(f"not Debian 12 packages: {', '.join(unknown)}")
    dev = [p for p in runtime_pkgs if p.endswith("-dev")]
    if dev:
        raise Fail(f"the runtime stage installs development packages: {', '.join(dev)}")

    # Programs built = programs copied, and their libraries are installed.
    targets = []
    for r in runs(build):
        m = re.search(r"cmake --build .*--target ((?:[\w-]+ ?)+)", r)
        if m:
            targets = m.group(1).split()
    if not targets:
        raise Fail("the build stage does not name its --target programs")
    # An image runs on other machines than the one that built it: the build must not use the
    # release preset's -march=native.
    presets = {m.group(1) for r in runs(build) for m in re.finditer(r"cmake (?:--build )?--preset (\S+)", r)}
    if presets != {"portable"}:
        raise Fail(f"the build stage uses preset(s) {sorted(presets)}; an image needs the portable preset alone")
    copied = []
    for ins, rest in runtime["instrs"]:
        if ins == "COPY":
            parts = shlex.split(rest)
            if "--from=build" not in parts:
                raise Fail(f"the runtime stage copies {rest!r} from the build context, not the build stage")
            for p in [p for p in parts[:-1] if not p.startswith("--")]:
                if not p.startswith(os.path.join(workdir, "build/portable/bin/")):
                    raise Fail(f"the runtime stage copies {p}, which is not a program of the build")
                copied.append(os.path.basename(p))
    if sorted(copied) != sorted(targets):
        raise Fail(f"built {sorted(targets)} but copied {sorted(copied)}")
    missing = {}
    for t in targets:
        if not os.access(os.path.join(bindir, t), os.X_OK):
            raise Fail(f"{t} is not a program this tree builds (no {os.path.join(bindir, t)})")
    for exe, libs in needed_packages([os.path.join(bindir, t) for t in targets]).items():
        for lib, pkg in libs.items():
            if pkg not in runtime_pkgs and pkg not in BASE_PACKAGES:
                missing.setdefault(pkg, set()).add(f"{os.path.basename(exe)}: {lib}")
    if missing:
        raise Fail("the runtime stage lacks " + "; ".join(f"{p} ({', '.join(sorted(w))})" for p, w in missing.items()))
    print(f"containerfile_test: ok: {len(targets)} programs, {len(runtime_pkgs)} runtime packages cover "
          f"their libraries; {len(every)} packages of install-deps.sh ({len(listed)} for building), "
          f"all real Debian 12 packages")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: containerfile_test.py SOURCE_DIR BIN_DIR", file=sys.stderr)
        sys.exit(2)
    try:
        sys.exit(main(sys.argv[1], sys.argv[2]))
    except Fail as e:
        print(f"containerfile_test: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
