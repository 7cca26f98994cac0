#!/bin/sh
# Peak resident memory while loading a Hugging Face directory: one process against each rank of
# --tp 2 (bench/results/2026-12-06-hf-load.md). The directory is Llama-3.2-1B's shape in bf16
# (16 layers, 32 heads, 8 KV heads, d_model 2048, ffn 8192, vocab 128256, tied; random weights),
# written once by save_hf. The loads are the integration test's child (tests/integration/hf):
# a process that builds the rank's layout, allocates its fp32 buffer, runs load_hf and prints its
# VmHWM. Needs about 2.5 GB of disk and 5 GB of memory (the one-process load).
#   bench/hf_load.sh [DIR]
set -eu
BIN=${BIN:-build/release/bin}
DIR=${1:-/tmp/trn-hf-llama-3.2-1b}
T=$BIN/trn_integration_hf
if [ ! -f "$DIR/config.json" ]; then
  echo "writing $DIR"
  "$T" --trn-child hf_write_llama "$DIR" 16 32 8 2048 8192 128256
fi
du -sh "$DIR"
echo "one process:"
"$T" --trn-child hf_load_rss "$DIR" 1 0
echo "tp 2 (both ranks at once):"
"$T" --trn-child hf_load_rss "$DIR" 2 0 &
"$T" --trn-child hf_load_rss "$DIR" 2 1
wait
