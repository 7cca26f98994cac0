#!/usr/bin/env bash
# The main job on this machine, from a fresh clone: installs what is missing, builds, then
# trains GPT `tiny` on the built-in corpus with 2 data-parallel workers launched by trnrun
# (embedded coordinator on loopback), and saves the final weights to out/tiny.safetensors.
# Extra arguments go to trn-train (e.g. ./run.sh --steps 500).
set -euo pipefail
cd "$(dirname "$0")"
preset=${PRESET:-release}
./deploy/install-deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
bin=build/$preset/bin
mkdir -p out
exec "$bin/trnrun" --nproc-per-node 2 -- "$bin/trn-train" --dp 2 --model tiny --steps 200 \
  --batch-size 16 --threads 1 --log-every 10 --bucket-mb 0.5 --save out/tiny.safetensors "$@"
