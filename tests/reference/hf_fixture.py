#!/usr/bin/python3
"""Small Hugging Face model directories for tests, and their reference logits (system interpreter).

No model hub is reachable from the test machines, so the tests build directories in the real
configs' structure with small dimensions and random weights:

  llama3  Llama-3.2-1B's config.json fields (LlamaForCausalLM, head_dim, rope_scaling of rope_type
          "llama3" with factor 32, rope_theta 500000, tied embeddings, eos ids of the instruct
          model's generation_config.json);
  qwen2   Qwen2.5-0.5B's (Qwen2ForCausalLM: q/k/v biases, rope_theta 1e6, rms_norm_eps 1e-6,
          tied embeddings, use_sliding_window false).

write DIR --kind K [--shards N] [--spelling v4|v5] [--seed S] [--tokens "1 2 3" --out FILE]
    config.json (transformers v4's rope_scaling / torch_dtype, or v5's rope_parameters / dtype),
    generation_config.json, and the weights in bf16 as model.safetensors, or as N shards
    model-0000i-of-0000N.safetensors with model.safetensors.index.json (sorted weight_map,
    metadata.total_size), each with {"format": "pt"}. Written to a temporary sibling and renamed.
    With --tokens and --out, then what `logits` gives for the directory written (one interpreter
    start for both).
logits DIR --tokens "1 2 3" --out FILE
    The reference forward (llama_reference.Llama, fp32, on the directory's bf16 weights widened)
    of one sequence: float32 logits (T, vocab), little-endian, row-major.
check-generate DIR --trn-generate BIN --workdir W [--init-hf]
    The directory's weights widened to fp32 in trn's own file (the family's names, trn.model
    metadata; the vocabulary cut to 256 rows for byte-level text), or with --init-hf the directory
    itself (config.json, bf16 shards; written with --vocab 256), greedy trn-generate on a byte prompt with --dump-logits, and each dumped row (the
    prompt's last position, then every decoded one: the KV-cached path) against the reference
    forward of the same tokens, to 1e-4 relative to the largest logit. Exits 1 on a mismatch.
check-layouts DIR --trn-train BIN --trnrun BIN --trn-generate BIN --workdir W
    DIR (written with --vocab 256) loaded by trn-train --init-hf on 2 ranks at each of --tp 2,
    --pp 2, --dp 2 --zero 1 and --dp 2 --zero 3, for one step at lr 0 that writes --save-hf:
    the step's loss and gradient norm (the forward and backward at that layout, on the batch
    --dump-batches wrote) within 1e-4 relative of PyTorch's on DIR's weights; the saved weights
    bit for bit DIR's (each rank loaded its slices right, the gather put them back); and the
    saved directory's logits (check-generate --init-hf) within 1e-4 of the reference forward.
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import subprocess  # noqa: E402

from gpt2_reference import save_safetensors  # noqa: E402
from llama_reference import Llama, describe, spec_tensors  # noqa: E402

KINDS = {
    "llama3": dict(
        hf={"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
            "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 160,
            "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "use_cache": True, "vocab_size": 320,
            "head_dim": 16},
        rope={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        generation={"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
                    "temperature": 0.6, "top_p": 0.9}),
    "qwen2": dict(
        hf={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 64,
            "initializer_range": 0.02, "intermediate_size": 176, "max_position_embeddings": 32768,
            "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
            "use_cache": True, "use_sliding_window": False, "vocab_size": 352},
        rope=None,
        generation={"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.8}),
}


def reference_config(hf, rope):
    """llama_reference's configuration dict from config.json's fields."""
    c = dict(n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"], n_kv_head=hf["num_key_value_heads"],
             d_model=hf["hidden_size"], ffn_dim=hf["intermediate_size"], ctx=hf["max_position_embeddings"],
             vocab=hf["vocab_size"], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
             tie_embeddings=hf["tie_word_embeddings"])
    if "head_dim" in hf and hf["head_dim"] != hf["hidden_size"] // hf["num_attention_heads"]:
        c["head_dim"] = hf["head_dim"]
    if hf["model_type"] == "qwen2":
        c["qkv_bias"] = True
    if rope and rope.get("rope_type") == "llama3":
        c["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")}
    return c


def read_config(d):
    """config.json in either spelling -> (its fields, the rope scaling dict or None)."""
    with open(os.path.join(d, "config.json")) as f:
        hf = json.load(f)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters")
    if rope and "rope_theta" in rope:  # v5 keeps rope_theta inside rope_parameters
        hf.setdefault("rope_theta", rope["rope_theta"])
    if rope and rope.get("rope_type", "default") == "default":
        rope = None
    return hf, rope


def tensor_bytes(t):
    """bf16 bytes of t, little-endian (bf16 is the upper half of the fp32 pattern, rounded to nearest even)."""
    return t.detach().contiguous().to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def write_safetensors(path, tensors):
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, data in tensors:
        header[name] = {"dtype": "BF16", "shape": data[1], "data_offsets": [offset, offset + len(data[0])]}
        chunks.append(data[0])
        offset += len(data[0])
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode() + b"".join(chunks))
        f.flush()
        os.fsync(f.fileno())


def write(a):
    kind = KINDS[a.kind]
    hf, rope = dict(kind["hf"]), kind["rope"]
    if a.vocab:
        hf["vocab_size"] = a.vocab
    c = reference_config(hf, rope)
    torch.manual_seed(a.seed)
    model = Llama(c)
    with torch.no_grad():  # biases of a trained model are not zero
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    state = model.state_dict()
    names = list(spec_tensors(c))  # model order; the tied head has no lm_head.weight
    assert sorted(names) == sorted(state), (sorted(set(names) ^ set(state)))
    if a.spelling == "v4":
        hf["torch_dtype"] = "bfloat16"
        hf["transformers_version"] = "4.45.0"
        if rope:
            hf["rope_scaling"] = rope
    else:
        hf["dtype"] = "bfloat16"
        hf["transformers_version"] = "5.0.0"
        hf["rope_parameters"] = dict(rope or {"rope_type": "default"}, rope_theta=hf.pop("rope_theta"))
    final = os.path.abspath(a.dir)
    if os.path.exists(final):
        sys.exit(f"{final} exists")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    data = [(n, (tensor_bytes(state[n]), list(state[n].shape))) for n in names]
    if a.shards <= 1:
        write_safetensors(os.path.join(tmp, "model.safetensors"), data)
    else:
        total = sum(len(d[0]) for _, d in data)
        per = -(-total // a.shards)
        groups, size = [[]], 0
        for item in data:
            if size >= per * len(groups) and len(groups) < a.shards:
                groups.append([])
            groups[-1].append(item)
            size += len(item[1][0])
        assert len(groups) == a.shards, f"{len(data)} tensors do not fill {a.shards} shards"
        weight_map = {}
        for i, g in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{a.shards:05d}.safetensors"
            write_safetensors(os.path.join(tmp, fname), g)
            for n, _ in g:
                weight_map[n] = fname
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(dict(kind["generation"], transformers_version=hf["transformers_version"]), f, indent=2)
    os.replace(tmp, final)
    print(f"wrote {final}: {a.kind}, {len(names)} tensors, {a.shards} shard(s), config.json in {a.spelling}'s spelling")
    if a.tokens is not None:
        logits(argparse.Namespace(dir=final, tokens=a.tokens, out=a.out))


def read_weights(d):
    """The directory's tensors widened to fp32 (bf16, f16 or f32), through the index when there is one."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for fname in files:
        with open(os.path.join(d, fname), "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        for name, e in header.items():
            if name == "__metadata__":
                continue
            b, end = e["data_offsets"]
            buf = raw[8 + n + b:8 + n + end]
            if e["dtype"] == "BF16":
                bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
                arr = bits.view(np.float32)
            elif e["dtype"] == "F16":
                arr = np.frombuffer(buf, dtype="<f2").astype(np.float32)
            else:
                arr = np.frombuffer(buf, dtype="<f4")
            out[name] = torch.from_numpy(arr.reshape(e["shape"]).copy())
    return out


def logits(a):
    hf, rope = read_config(a.dir)
    c = reference_config(hf, rope)
    model = Llama(c)
    model.load_state_dict(read_weights(a.dir), strict=True)
    ids = torch.tensor([[int(t) for t in a.tokens.split()]], dtype=torch.int64)
    with torch.no_grad():
        out = model.logits(ids)[0].to(torch.float32).contiguous()
    out.numpy().astype("<f4").tofile(a.out)
    print(f"{a.out}: logits ({out.shape[0]}, {out.shape[1]})")


def check_generate(a):
    hf, rope = read_config(a.dir)
    c = reference_config(hf, rope)
    c["ctx"] = min(c["ctx"], 256)  # trn's decoder caches ctx positions; the prompt needs few
    # Without a tokenizer trn-generate's text is bytes: the vocabulary cut to its first 256 rows.
    weights = read_weights(a.dir)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in weights:
            weights[name] = weights[name][:256].contiguous()
    c["vocab"] = 256
    model = Llama(c)
    model.load_state_dict(weights, strict=True)
    os.makedirs(a.workdir, exist_ok=True)
    init = os.path.join(a.workdir, "model.safetensors")
    if a.init_hf and hf["vocab_size"] != 256:
        sys.exit("check-generate --init-hf needs a directory written with --vocab 256 (byte-level text)")
    save_safetensors(init, model.state_dict())
    with open(init, "rb") as f:  # trn.model metadata, as trn-train --save writes it
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"format": "pt", "trn.model": describe(c)}
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    with open(init, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n:])
    prompt, new = "Hello, HF!", 5
    dump = os.path.join(a.workdir, "logits.bin")
    source = ["--init-hf", a.dir] if a.init_hf else ["--model", init]
    cmd = [a.trn_generate] + source + ["--prompt", prompt, "--max-new-tokens", str(new), "--temperature", "0",
           "--dump-logits", dump]
    print("$ " + " ".join(cmd))
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if run.returncode != 0:
        print(run.stdout)
        print(f"FAIL: trn-generate exited {run.returncode}")
        return 1
    rows = np.fromfile(dump, dtype="<f4").reshape(-1, c["vocab"])
    ids = list(prompt.encode())
    for r in rows[:-1]:
        ids.append(int(np.argmax(r)))  # greedy: the first of the largest
    with torch.no_grad():
        ref = model.logits(torch.tensor([ids], dtype=torch.int64))[0].numpy()
    want = ref[len(prompt.encode()) - 1:]
    worst = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(rows, want))
    ok = len(rows) == new and worst <= 1e-4
    print(f"{len(rows)} rows (the prompt's last position, then {len(rows) - 1} decoded): worst difference "
          f"{worst:.2e} of the largest logit (limit 1e-4)")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


LAYOUTS = [["--tp", "2"], ["--pp", "2", "--micro-batches", "4"], ["--dp", "2", "--zero", "1"],
           ["--dp", "2", "--zero", "3"]]


def check_layouts(a):
    hf, rope = read_config(a.dir)
    if hf["vocab_size"] != 256:
        sys.exit("check-layouts needs a directory written with --vocab 256 (check-generate's byte-level text)")
    c = reference_config(hf, rope)
    c["ctx"] = min(c["ctx"], 256)
    source = read_weights(a.dir)
    model = Llama(c)
    model.load_state_dict(source, strict=True)
    failures = 0
    for layout in LAYOUTS:
        name = "-".join(x.strip("-") for x in layout)
        work = os.path.join(a.workdir, name)
        os.makedirs(work, exist_ok=True)
        metrics, batches, out = (os.path.join(work, n) for n in ("metrics.jsonl", "batches.bin", "saved"))
        cmd = [a.trnrun, "--nproc-per-node", "2", "--", a.trn_train, "--init-hf", a.dir, "--steps", "1",
               "--batch-size", "4", "--seq-len", "16", "--lr", "0", "--threads", "1", "--metrics-jsonl", metrics,
               "--dump-batches", batches, "--save-hf", out] + layout
        print("$ " + " ".join(cmd))
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        if run.returncode != 0:
            print(run.stdout)
            print(f"FAIL {name}: trn-train exited {run.returncode}")
            failures += 1
            continue
        step = next(m for m in map(json.loads, open(metrics)) if m.get("step") == 1)
        tokens = torch.from_numpy(np.fromfile(batches, dtype="<i4").reshape(4, 17).astype(np.int64))
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
        rel_loss = abs(step["loss"] - loss.item()) / abs(loss.item())
        rel_norm = abs(step["grad_norm"] - norm) / norm
        saved = read_weights(out)
        same = sorted(saved) == sorted(source) and all(torch.equal(saved[k], source[k]) for k in source)
        print(f"{name}: loss trn {step['loss']:.8f} torch {loss.item():.8f} (rel {rel_loss:.1e}), gradient norm "
              f"trn {step['grad_norm']:.8f} torch {norm:.8f} (rel {rel_norm:.1e}), saved weights "
              f"{'bit for bit the source' if same else 'DIFFER from the source'}")
        ok = rel_loss <= 1e-4 and rel_norm <= 1e-4 and same
        if ok:
            ok = check_generate(argparse.Namespace(dir=out, trn_generate=a.trn_generate, workdir=work + "-generate",
                                                   init_hf=True)) == 0
        if not ok:
            print(f"FAIL {name}")
            failures += 1
    print("PASS" if failures == 0 else f"FAIL: {failures} of {len(LAYOUTS)} layouts")
    return 0 if failures == 0 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir")
    w.add_argument("--kind", choices=sorted(KINDS), required=True)
    w.add_argument("--shards", type=int, default=2)
    w.add_argument("--spelling", choices=["v4", "v5"], default="v4")
    w.add_argument("--seed", type=int, default=1234)
    w.add_argument("--vocab", type=int, default=0, help="another vocab_size (256: trn-generate's byte-level text)")
    w.add_argument("--tokens", help="then the reference logits of these token ids (as `logits`) into --out")
    w.add_argument("--out")
    lg = sub.add_parser("logits")
    lg.add_argument("dir")
    lg.add_argument("--tokens", required=True, help="token ids separated by spaces")
    lg.add_argument("--out", required=True)
    cg = sub.add_parser("check-generate")
    cg.add_argument("dir")
    cg.add_argument("--trn-generate", default="trn-generate")
    cg.add_argument("--workdir", default="/tmp/trn-hf-fixture")
    cg.add_argument("--init-hf", action="store_true",
                    help="trn-generate reads DIR itself (its vocab_size must be 256) instead of trn's own file")
    cl = sub.add_parser("check-layouts")
    cl.add_argument("dir")
    cl.add_argument("--trn-train", default="trn-train")
    cl.add_argument("--trnrun", default="trnrun")
    cl.add_argument("--trn-generate", default="trn-generate")
    cl.add_argument("--workdir", default="/tmp/trn-hf-layouts")
    a = p.parse_args()
    if a.mode == "check-generate":
        sys.exit(check_generate(a))
    if a.mode == "check-layouts":
        sys.exit(check_layouts(a))
    if a.mode == "write" and (a.tokens is None) != (a.out is None):
        p.error("write: --tokens and --out go together")
    (write if a.mode == "write" else logits)(a)


if __name__ == "__main__":
    main()
