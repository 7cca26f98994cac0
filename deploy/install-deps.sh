#!/usr/bin/env bash
# Installs every Debian 12 package trn builds, tests and runs with. Idempotent: only what is
# missing is fetched. Runs as root, or through sudo when it is available.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libfabric-dev libfabric-bin
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libspdlog-dev libfmt-dev catch2
  libopenmpi-dev openmpi-bin
  libopenblas-dev
  libcivetweb-dev libxxhash-dev nlohmann-json3-dev
  python3 python3-torch python3-numpy
  procps iproute2 curl openssl
  iptables libnetfilter-queue-dev util-linux
)

missing=()
for p in "${packages[@]}"; do
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

echo "trn: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
