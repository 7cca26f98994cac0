#!/bin/bash
# Checkpoint save and load speed against the disk's own sequential write speed, in one run.
#   bench/ckpt_bench.sh [BIN_DIR] [DIR]     (DIR: where to write, default a temporary directory)
# For `small` and a gpt2-sized model: the background write (what a synchronous save would block
# the step for), the time the step blocked with the asynchronous save, and the load on resume.
set -euo pipefail
BIN=${1:-build/release/bin}
DIR=${2:-$(mktemp -d)}
mb_s() { /usr/bin/python3 -c "print(f'{$1 / 1e6 / ($2 / 1e3):.0f}')"; }
dd_out=$(dd if=/dev/zero of="$DIR/dd.bin" bs=1M count=512 conv=fsync 2>&1 | tail -1)
rm -f "$DIR/dd.bin"
echo "disk: dd 512 MiB with fsync: $dd_out"
echo "| model | checkpoint MB | background write ms (MB/s) | step blocked ms | load ms (MB/s) |"
echo "|---|---|---|---|---|"
for spec in "small --batch-size 8 --seq-len 128" "gpt2 --batch-size 1 --seq-len 32"; do
  set -- $spec
  ck="$DIR/ck-$1"; rm -rf "$ck"; mkdir -p "$ck"
  log=$("$BIN/trn-train" --model $spec --steps 3 --checkpoint-dir "$ck" --checkpoint-every 1 --keep-checkpoints 1 2>&1)
  bytes=$(stat -c %s "$ck"/step-*/rank-*.shard | awk '{s += $1} END {print s}')
  write_ms=$(echo "$log" | grep -o '([0-9]* ms in the background)' | tail -1 | grep -o '[0-9]*')
  # the first save's: later ones may wait for the one before (at most one in flight)
  block_ms=$(echo "$log" | grep -o 'blocked [0-9.]* ms' | head -1 | grep -o '[0-9.]*')
  load=$("$BIN/trn-train" --model $spec --steps 3 --checkpoint-dir "$ck" --resume "$ck/step-00000003" 2>&1 | grep -o 'loaded in [0-9]* ms' | grep -o '[0-9]*')
  echo "| $1 | $((bytes / 1000000)) | $write_ms ($(mb_s $bytes $write_ms)) | $block_ms | $load ($(mb_s $bytes $load)) |"
  rm -rf "$ck"
done
