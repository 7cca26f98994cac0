#!/usr/bin/env python3
"""trn-generate against PyTorch: greedy output and logits of the same weights, token for token.

For each case, trains a tiny model for a few steps with `trn-train --save`, runs `trn-generate
--temperature 0 --dump-logits` on a prompt, then loads the saved file into the PyTorch reference
model of its family (gpt2_reference.GPT2, llama_reference.Llama; load_state_dict strict) and
decodes greedily with no cache, recomputing the whole sequence each step. Checks that every token
trn-generate chose is PyTorch's argmax, and that the logits trn computed with its KV cache (the
prefill's and each incremental step's) equal the full forward's. Exits 1 on any mismatch.

  generate_reference.py --trn-train build/release/bin/trn-train \\
      --trn-generate build/release/bin/trn-generate [--case gpt2 --case llama-tied-kv1 ...]
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_reference import GPT2, load_safetensors  # noqa: E402
from llama_reference import Llama  # noqa: E402

# case -> trn-train model flags
CASES = {
    "gpt2": ["--model", "tiny"],
    "llama-untied-kv2": ["--model", "llama-tiny"],
    "llama-tied-kv1": ["--model", "llama-tiny", "--tie-embeddings", "1", "--n-kv-head", "1"],
    "llama-untied-kv1": ["--model", "llama-tiny", "--n-kv-head", "1"],
    "llama-tied-kv2": ["--model", "llama-tiny", "--tie-embeddings", "1"],
}

LOGIT_TOL = 1e-4  # fp32, different summation orders (BLAS, cache vs full attention)


def metadata(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n)).get("__metadata__", {})


def parse_config(described):
    """trn.model's "k=v ..." (model::Config::describe) as the reference models' config dict."""
    c = {"arch": "gpt2"}
    for kv in described.split():
        k, v = kv.split("=")
        c[k] = v if k == "arch" else float(v) if k in ("rope_theta", "norm_eps") else int(v)
    if "tie_embeddings" in c:
        c["tie_embeddings"] = bool(c["tie_embeddings"])
    return c


def reference_model(path):
    c = parse_config(metadata(path)["trn.model"])
    model = GPT2(c) if c["arch"] == "gpt2" else Llama(c)
    model.load_state_dict(load_safetensors(path), strict=True)
    return model.eval(), c


def full_logits(model, c, idx):
    """Logits of the last position, the whole sequence recomputed (no cache)."""
    if c["arch"] != "gpt2":
        return model.logits(idx)[0, -1]
    T = idx.shape[1]
    x = model.wte(idx) + model.wpe(torch.arange(T))
    for block in model.h:
        x = block(x)
    return (model.ln_f(x) @ model.wte.weight.t())[0, -1]


def run_case(a, name):
    work = os.path.join(a.workdir, name)
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "model.safetensors")
    train = [a.trn_train, *CASES[name], "--steps", str(a.steps), "--seq-len", "64", "--batch-size", "4",
             "--lr", "3e-3", "--save", path]
    r = subprocess.run(train, capture_output=True, text=True, env={**os.environ, "TRN_LOG_LEVEL": "warn"})
    if r.returncode != 0:
        print(f"{name}: trn-train failed ({r.returncode}): {r.stdout}{r.stderr}")
        return False
    dump = os.path.join(work, "logits.f32")
    gen = [a.trn_generate, "--model", path, "--prompt", a.prompt, "--max-new-tokens", str(a.new_tokens),
           "--temperature", "0", "--dump-logits", dump]
    r = subprocess.run(gen, capture_output=True)
    if r.returncode != 0:
        print(f"{name}: trn-generate failed ({r.returncode}): {r.stdout!r} {r.stderr!r}")
        return False
    out = r.stdout
    prompt = a.prompt.encode()
    if not out.startswith(prompt) or not out.endswith(b"\n"):
        print(f"{name}: trn-generate printed {out!r}, not the prompt, its continuation and a newline")
        return False
    trn_tokens = list(out[len(prompt):-1])
    trn_logits = np.fromfile(dump, dtype="<f4").reshape(-1, 256)
    if len(trn_tokens) != a.new_tokens or trn_logits.shape[0] != a.new_tokens:
        print(f"{name}: {len(trn_tokens)} tokens and {trn_logits.shape[0]} logit rows, expected {a.new_tokens}")
        return False

    model, c = reference_model(path)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    ok, worst = True, 0.0
    with torch.no_grad():
        for i in range(a.new_tokens):
            ref = full_logits(model, c, idx)
            diff = float((torch.from_numpy(trn_logits[i].copy()) - ref).abs().max())
            worst = max(worst, diff)
            greedy = int(torch.argmax(ref))
            if diff > LOGIT_TOL or greedy != trn_tokens[i]:
                top2 = torch.topk(ref, 2).values
                print(f"{name}: step {i}: trn chose {trn_tokens[i]}, PyTorch {greedy} (its top two logits "
                      f"{float(top2[0]):.6f} {float(top2[1]):.6f}); logits differ by up to {diff:.3g}")
                ok = False
                break
            idx = torch.cat([idx, torch.tensor([[greedy]])], dim=1)
    text = bytes(trn_tokens).decode("utf-8", "replace")
    print(f"{name}: {'ok' if ok else 'MISMATCH'}: {len(trn_tokens)} greedy tokens equal, logits within {worst:.3g} "
          f"(tolerance {LOGIT_TOL}): {text!r}")
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trn-train", default="trn-train")
    p.add_argument("--trn-generate", default="trn-generate")
    p.add_argument("--workdir", default="/tmp/trn-generate-reference")
    p.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompt", default="First Citizen:\nBefore we proceed")
    p.add_argument("--new-tokens", type=int, default=40)
    a = p.parse_args()
    torch.manual_seed(0)
    results = [run_case(a, n) for n in (a.case or list(CASES))]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
