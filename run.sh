#!/usr/bin/env bash
# The main path on this machine, from a fresh clone: installs what is missing, builds, then goes
# from a folder of text to a model that writes. The text is the licenses every Debian machine
# has (/usr/share/common-licenses): trn-data trains a SentencePiece tokenizer on it and writes
# token shards (train and val); trnrun starts 2 data-parallel workers (embedded coordinator on
# loopback) that train llama-tiny on the shards, reporting the validation loss; trn-generate
# continues a prompt with the trained model. Everything goes to out/. Extra arguments go to
# trn-train (e.g. ./run.sh --steps 600).
set -euo pipefail
cd "$(dirname "$0")"
preset=${PRESET:-release}
./deploy/install-deps.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
bin=build/$preset/bin
text='/usr/share/common-licenses/*'
mkdir -p out
"$bin/trn-data" tokenizer train --input "$text" --vocab 2000 --model-type bpe --out out/tok.model
rm -rf out/shards  # tokenize writes a new directory whole: it refuses to mix into a previous run's
"$bin/trn-data" tokenize --tokenizer out/tok.model --input "$text" --out out/shards --threads 2
"$bin/trnrun" --nproc-per-node 2 -- "$bin/trn-train" --arch llama --model llama-tiny --dp 2 \
  --data out/shards --val-data out/shards --eval-every 100 --steps 300 --batch-size 8 --seq-len 128 \
  --lr 3e-3 --warmup-steps 20 --log-every 50 --save out/licenses.safetensors "$@"
"$bin/trn-generate" --model out/licenses.safetensors --tokenizer out/tok.model \
  --prompt "Permission is hereby granted" --max-new-tokens 40
