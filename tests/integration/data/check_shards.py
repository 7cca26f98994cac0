#!/usr/bin/python3
"""Checks trn-data's shards against the MMIDIDX specification and the sentencepiece module.

usage: check_shards.py MODEL DIR FILE...   (FILE: the corpus, in the order trn-data sorts it)

The reader below follows Megatron's indexed-dataset format, not trn's code: the .idx header
(magic, version 1, dtype code, sequence and document counts), sizes, byte pointers and document
indices, and a .bin of exactly the bytes the pointers describe. The expected documents are the
sentencepiece module's encode() of each file's non-empty lines, back to back, then EOS. Every
file must appear once, in order within its split (train or val). Prints one summary line; any
disagreement raises.
"""
import glob
import os
import struct
import sys

import numpy as np
import sentencepiece

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


def read_shard(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00", f"{prefix}.idx: magic {idx[:9]!r}"
    version, = struct.unpack_from("<Q", idx, 9)
    assert version == 1, f"{prefix}.idx: version {version}"
    code, = struct.unpack_from("<B", idx, 17)
    s, d = struct.unpack_from("<QQ", idx, 18)
    off = 34
    sizes = np.frombuffer(idx, dtype="<i4", count=s, offset=off)
    off += 4 * s
    pointers = np.frombuffer(idx, dtype="<i8", count=s, offset=off)
    off += 8 * s
    doc_idx = np.frombuffer(idx, dtype="<i8", count=d, offset=off)
    off += 8 * d
    assert off == len(idx), f"{prefix}.idx: {len(idx)} bytes, the header says {off}"
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    item = dtype.itemsize
    # One sequence per document: doc_idx is 0, 1, ..., S.
    assert d == s + 1 and list(doc_idx) == list(range(s + 1)), f"{prefix}.idx: doc_idx {list(doc_idx)[:8]}..."
    expect = 0
    for i in range(s):
        assert pointers[i] == expect, f"{prefix}.idx: pointer {i} is {pointers[i]}, expected {expect}"
        assert sizes[i] > 0
        expect += int(sizes[i]) * item
    binary = open(prefix + ".bin", "rb").read()
    assert len(binary) == expect, f"{prefix}.bin: {len(binary)} bytes, the index says {expect}"
    seqs = [np.frombuffer(binary, dtype=dtype, count=int(sizes[i]), offset=int(pointers[i])).astype(np.int64).tolist()
            for i in range(s)]
    return code, seqs


def main():
    model, out, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    want_code = 8 if sp.get_piece_size() < 65500 else 4
    splits, shard_count = {}, {}
    for split in ("train", "val"):
        prefixes = sorted(p[:-4] for p in glob.glob(os.path.join(out, split + "-*.idx")))
        for n, p in enumerate(prefixes):
            assert os.path.basename(p) == f"{split}-{n:05d}", f"shard names: {prefixes}"
        splits[split] = []
        for p in prefixes:
            code, seqs = read_shard(p)
            assert code == want_code, f"{p}: dtype code {code}, expected {want_code}"
            splits[split] += seqs
        shard_count[split] = len(prefixes)
    pos = {"train": 0, "val": 0}
    for f in files:
        text = open(f, encoding="utf-8").read()
        ids = []
        for line in text.split("\n"):
            if line:
                ids += sp.encode(line)
        if sp.eos_id() >= 0:
            ids.append(sp.eos_id())
        for split in ("train", "val"):
            i = pos[split]
            if i < len(splits[split]) and splits[split][i] == ids:
                pos[split] += 1
                break
        else:
            raise AssertionError(f"{f}: its tokens are not the next document of train or val")
    for split in ("train", "val"):
        assert pos[split] == len(splits[split]), f"{split}: {len(splits[split]) - pos[split]} documents left over"
    tokens = sum(len(s) for v in splits.values() for s in v)
    print(f"ok: {len(files)} documents, {tokens} tokens, train {len(splits['train'])} documents in "
          f"{shard_count['train']} shards, val {len(splits['val'])} documents in {shard_count['val']} shards")


if __name__ == "__main__":
    main()
