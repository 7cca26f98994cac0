#!/usr/bin/python3
"""Tokenize throughput: trn-data tokenize vs the sentencepiece Python module's encode, on the same
model and the same file, at each thread count. The file is /usr/share/common-licenses' text
repeated to about --mb MB (one document; trn-data cuts it into pieces of whole lines that its
threads encode). The module encodes the same non-empty lines as one list, encode(lines,
num_threads=N), the way trn-data does (it then also writes the shards; the module only returns
ids). In each round every side runs once per thread count, alternating (trn, module, trn, module);
MB/s is the median over rounds, of the file's bytes over wall time (trn-data: the whole process,
reading and writing included; the module: the encode call alone). Prints one markdown table.
Prints numbers only; asserts nothing.

  /usr/bin/python3 bench/tokenize.py --bin build/release/bin [--rounds 5] [--threads 1,2] [--mb 32]
"""
import argparse
import glob
import os
import platform
import statistics
import subprocess
import tempfile
import time

import sentencepiece


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--mb", type=float, default=32)
    p.add_argument("--vocab", type=int, default=4000)
    a = p.parse_args()
    trn_data = os.path.join(a.bin, "trn-data")
    threads = [int(t) for t in a.threads.split(",")]
    corpus = "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob("/usr/share/common-licenses/*"))
                     if os.path.isfile(f))
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "tok.model")
        subprocess.run([trn_data, "tokenizer", "train", "--input", "/usr/share/common-licenses/*", "--vocab",
                        str(a.vocab), "--model-type", "bpe", "--out", model], check=True, stdout=subprocess.DEVNULL)
        text = corpus * max(1, int(a.mb * 1e6 / len(corpus.encode())))
        path = os.path.join(d, "corpus.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        size = os.path.getsize(path)
        lines = [line for line in text.split("\n") if line]
        sp = sentencepiece.SentencePieceProcessor(model_file=model)
        rates = {(side, t): [] for side in ("trn-data", "sentencepiece") for t in threads}
        for r in range(a.rounds):
            for t in threads:
                out = os.path.join(d, f"out-{r}-{t}")
                t0 = time.perf_counter()
                subprocess.run([trn_data, "tokenize", "--tokenizer", model, "--input", path, "--out", out,
                                "--val-fraction", "0", "--threads", str(t)], check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                rates[("trn-data", t)].append(size / (time.perf_counter() - t0) / 1e6)
                subprocess.run(["rm", "-rf", out], check=True)
                t0 = time.perf_counter()
                sp.encode(lines, num_threads=t)
                rates[("sentencepiece", t)].append(size / (time.perf_counter() - t0) / 1e6)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"file {size / 1e6:.1f} MB, BPE vocabulary {a.vocab}, {a.rounds} rounds\n")
    print("| threads | trn-data MB/s | sentencepiece encode MB/s | trn-data / module |")
    print("|---:|---:|---:|---:|")
    for t in threads:
        trn = statistics.median(rates[("trn-data", t)])
        mod = statistics.median(rates[("sentencepiece", t)])
        print(f"| {t} | {trn:.2f} | {mod:.2f} | {trn / mod:.2f}x |")


if __name__ == "__main__":
    main()
