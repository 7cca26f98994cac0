#!/usr/bin/python3
"""PyTorch reference for trn's GPT-2 (runs under the system interpreter, /usr/bin/python3).

compare: builds the model of DESIGN.md in PyTorch with Hugging Face GPT-2 names, saves its
initial weights as safetensors, runs `trn-train --init` on that file (which also dumps the
batches it trains on), trains the same steps on the same batches here, and checks that the
per-step losses agree to 1e-4 relative, the final weights to 1e-4 max-abs, and that trn's saved
file loads with load_state_dict(strict=True). Exits 1 on any mismatch.

compare --precision bf16: the same, with `trn-train --precision bf16` against the PyTorch model
trained under torch.autocast("cpu", dtype=torch.bfloat16), and PyTorch fp32 beside both as the
yardstick; the tolerance is explained at compare_bf16.

bench: trains on random tokens and prints tokens/s and peak RSS (for the benchmark table).
"""
import argparse
import json
import math
import os
import resource
import struct
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {
    "tiny": dict(n_layer=2, n_head=4, d_model=128, ctx=128, vocab=256),
    "small": dict(n_layer=4, n_head=8, d_model=256, ctx=256, vocab=256),
    "gpt2": dict(n_layer=12, n_head=12, d_model=768, ctx=1024, vocab=50257),
}


class Conv1D(nn.Module):
    """A linear layer with the weight stored [in, out] (y = x W + b), as in GPT-2."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(shape)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c["n_head"]
        self.c_attn = Conv1D(c["d_model"], 3 * c["d_model"])
        self.c_proj = Conv1D(c["d_model"], c["d_model"])

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = Conv1D(c["d_model"], 4 * c["d_model"])
        self.c_proj = Conv1D(4 * c["d_model"], c["d_model"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["d_model"], eps=1e-5)
        self.attn = Attention(c)
        self.ln_2 = nn.LayerNorm(c["d_model"], eps=1e-5)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab"], c["d_model"])
        self.wpe = nn.Embedding(c["ctx"], c["d_model"])
        self.h = nn.ModuleList([Block(c) for _ in range(c["n_layer"])])
        self.ln_f = nn.LayerNorm(c["d_model"], eps=1e-5)
        proj_std = 0.02 / math.sqrt(2 * c["n_layer"])
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=proj_std)
            elif name.endswith(".weight") and "ln_" not in name:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()  # LM head tied to wte
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def save_safetensors(path, state):
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in state.items():
        data = t.detach().contiguous().to(torch.float32).numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text.encode() + b"".join(chunks))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert e["dtype"] == "F32", f"{name}: dtype {e['dtype']}"
        b, end = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + end], dtype="<f4").reshape(e["shape"])
        out[name] = torch.from_numpy(arr.copy())
    return out


def lr_at(s, a):
    if a.warmup_steps > 0 and s < a.warmup_steps:
        return a.lr * (s + 1) / a.warmup_steps
    if a.lr_schedule == "constant":
        return a.lr
    ratio = min(max((s - a.warmup_steps) / max(1, a.steps - a.warmup_steps), 0.0), 1.0)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.lr - a.min_lr)


def make_optimizer(model, a):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8)


def train_step(model, opt, x, y, lr, grad_clip, autocast=False):
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
    else:
        loss = model(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    return loss.item(), norm.item()


def compare(a, c):
    if a.precision == "bf16":
        return compare_bf16(a, c)
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = GPT2(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_safetensors(init, model.state_dict())
    metrics, final, batches = (os.path.join(a.workdir, n) for n in ("metrics.jsonl", "final.safetensors", "batches.bin"))
    cmd = [a.trn_train, "--model", a.model, "--init", init, "--steps", str(a.steps),
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
           "--lr-schedule", a.lr_schedule, "--warmup-steps", str(a.warmup_steps), "--min-lr", str(a.min_lr),
           "--weight-decay", str(a.weight_decay), "--beta1", str(a.beta1), "--beta2", str(a.beta2),
           "--grad-clip", str(a.grad_clip), "--seed", str(a.seed), "--threads", str(a.threads),
           "--metrics-jsonl", metrics, "--save", final, "--dump-batches", batches, "--log-every", "5"]
    if a.n_layer > 0:
        cmd += ["--n-layer", str(a.n_layer)]
    if a.tp * a.pp > 1:  # a tensor- and pipeline-parallel job of tp x pp workers on this node
        cmd = [a.trnrun, "--nproc-per-node", str(a.tp * a.pp), "--"] + cmd + ["--tp", str(a.tp), "--pp", str(a.pp)]
        if a.pp > 1:
            cmd += ["--micro-batches", str(a.batch_size)]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout)
        print(f"FAIL: trn-train exited {run.returncode}")
        return 1
    trn = [json.loads(line) for line in open(metrics)]
    tokens = np.fromfile(batches, dtype="<i4").reshape(a.steps, a.batch_size, a.seq_len + 1)
    tokens = torch.from_numpy(tokens.astype(np.int64))
    opt = make_optimizer(model, a)
    ok = True
    worst_loss = 0.0
    for s in range(a.steps):
        loss, norm = train_step(model, opt, tokens[s, :, :-1], tokens[s, :, 1:], lr_at(s, a), a.grad_clip)
        rel = abs(loss - trn[s]["loss"]) / abs(loss)
        worst_loss = max(worst_loss, rel)
        print(f"step {s + 1:3d}  torch loss {loss:.6f}  trn loss {trn[s]['loss']:.6f}  rel {rel:.2e}  "
              f"grad norm torch {norm:.5f} trn {trn[s]['grad_norm']:.5f}")
        if rel > 1e-4:
            ok = False
    trained = load_safetensors(final)
    worst_w, worst_name = 0.0, ""
    for name, t in model.state_dict().items():
        d = (t - trained[name]).abs().max().item()
        if d > worst_w:
            worst_w, worst_name = d, name
    print(f"losses: worst relative difference {worst_loss:.2e} (limit 1e-4)")
    print(f"final weights: worst max-abs difference {worst_w:.2e} in {worst_name} (limit 1e-4)")
    fresh = GPT2(c)
    fresh.load_state_dict(trained, strict=True)  # raises on a missing or unexpected key or shape
    with torch.no_grad():
        l_trn = fresh(tokens[0, :, :-1], tokens[0, :, 1:]).item()
        l_torch = model(tokens[0, :, :-1], tokens[0, :, 1:]).item()
    print(f"trn-saved weights loaded with strict=True: loss {l_trn:.6f} vs torch-trained {l_torch:.6f}")
    if worst_w > 1e-4 or abs(l_trn - l_torch) > 1e-4 * abs(l_torch):
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def run_trn(a, init, extra):
    """trn-train from init on a's settings; returns (metrics, final file, batches) or None."""
    metrics, final, batches = (os.path.join(a.workdir, n) for n in ("metrics.jsonl", "final.safetensors", "batches.bin"))
    cmd = [a.trn_train, "--model", a.model, "--init", init, "--steps", str(a.steps),
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
           "--lr-schedule", a.lr_schedule, "--warmup-steps", str(a.warmup_steps), "--min-lr", str(a.min_lr),
           "--weight-decay", str(a.weight_decay), "--beta1", str(a.beta1), "--beta2", str(a.beta2),
           "--grad-clip", str(a.grad_clip), "--seed", str(a.seed), "--threads", str(a.threads),
           "--metrics-jsonl", metrics, "--save", final, "--dump-batches", batches, "--log-every", "5"] + extra
    if a.n_layer > 0:
        cmd += ["--n-layer", str(a.n_layer)]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout)
        print(f"FAIL: trn-train exited {run.returncode}")
        return None
    for line in run.stdout.splitlines():
        if "precision bf16" in line:
            print(line.split("] ", 1)[-1])
    return [json.loads(line) for line in open(metrics)], final, batches


def compare_bf16(a, c):
    """trn-train --precision bf16 against PyTorch autocast bf16, with PyTorch fp32 as the yardstick.

    The two bf16 schemes round at different places. Autocast rounds every matmul's output and bias
    to bf16 (qkv, the attention scores, the MLP's hidden layer, the logits), multiplies the fp32
    softmax probabilities as bf16 in att @ v, runs GELU in bf16 and rounds each weight gradient
    to bf16; trn keeps all of those in fp32 and rounds only the matmuls' operands (and stores
    qkv as bf16). So neither is the other plus smaller noise, and the fair measure of "close" is
    how far bf16 moves PyTorch's own run from fp32: d_torch = |torch bf16 - torch fp32|, which
    only PyTorch's numbers set. Per step:
      |trn bf16 - torch bf16| <= 2 d_torch + 2e-3 loss   (trn lies within autocast's own spread)
      |trn bf16 - torch fp32| <=   d_torch + 2e-3 loss   (and is no farther from fp32 than it)
    The 2e-3 floor is half of bf16's unit roundoff (2^-8): on steps where autocast happens to land
    next to fp32, one rounding of the logits' scale must still pass. Measured, trn stays one to
    two orders of magnitude nearer fp32 than autocast; a wrong term or a stale weight copy is off
    by far more within a step or two.
    """
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = GPT2(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_safetensors(init, model.state_dict())
    model32 = GPT2(c)
    model32.load_state_dict(model.state_dict())
    got = run_trn(a, init, ["--precision", "bf16"])
    if got is None:
        return 1
    trn, final, batches = got
    tokens = np.fromfile(batches, dtype="<i4").reshape(a.steps, a.batch_size, a.seq_len + 1)
    tokens = torch.from_numpy(tokens.astype(np.int64))
    opt, opt32 = make_optimizer(model, a), make_optimizer(model32, a)
    ok = True
    worst = worst_ratio = 0.0
    for s in range(a.steps):
        x, y = tokens[s, :, :-1], tokens[s, :, 1:]
        lb, _ = train_step(model, opt, x, y, lr_at(s, a), a.grad_clip, autocast=True)
        lf, _ = train_step(model32, opt32, x, y, lr_at(s, a), a.grad_clip)
        lt = trn[s]["loss"]
        d, d_torch, d_fp32 = abs(lt - lb), abs(lb - lf), abs(lt - lf)
        limit, limit32 = 2 * d_torch + 2e-3 * abs(lb), d_torch + 2e-3 * abs(lf)
        worst = max(worst, d / abs(lb))
        worst_ratio = max(worst_ratio, d / limit, d_fp32 / limit32)
        print(f"step {s + 1:3d}  torch bf16 {lb:.6f}  trn bf16 {lt:.6f}  torch fp32 {lf:.6f}  "
              f"trn-torch rel {d / abs(lb):.2e}  bf16-fp32 rel torch {abs(lb - lf) / abs(lf):.2e} "
              f"trn {abs(lt - lf) / abs(lf):.2e}")
        if d > limit or d_fp32 > limit32:
            ok = False
    print(f"losses: worst relative difference trn bf16 vs torch autocast bf16 {worst:.2e}; "
          f"worst difference / per-step limit {worst_ratio:.2f} (limit 1)")
    fresh = GPT2(c)
    fresh.load_state_dict(load_safetensors(final), strict=True)  # the fp32 master, as always
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def bench(a, c):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = GPT2(c)
    opt = make_optimizer(model, a)
    g = torch.Generator().manual_seed(a.seed)
    data = torch.randint(0, c["vocab"], (a.steps + a.warmup_bench, a.batch_size, a.seq_len + 1), generator=g)
    autocast = a.precision == "bf16"
    for s in range(a.warmup_bench):
        train_step(model, opt, data[s, :, :-1], data[s, :, 1:], a.lr, a.grad_clip, autocast)
    t0 = time.perf_counter()
    for s in range(a.warmup_bench, a.warmup_bench + a.steps):
        train_step(model, opt, data[s, :, :-1], data[s, :, 1:], a.lr, a.grad_clip, autocast)
    dt = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch {a.model} {a.precision} batch {a.batch_size}x{a.seq_len} threads {a.threads}: "
          f"{a.steps * a.batch_size * a.seq_len / dt:.0f} tok/s, peak RSS {rss_mb:.0f} MB")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["compare", "bench"])
    p.add_argument("--trn-train", default="trn-train")
    p.add_argument("--trnrun", default="trnrun", help="launcher for --tp or --pp > 1")
    p.add_argument("--tp", type=int, default=1, help="train trn with this many tensor-parallel workers")
    p.add_argument("--pp", type=int, default=1, help="... times this many pipeline stages (1F1B, a micro-batch per sequence)")
    p.add_argument("--workdir", default="/tmp/trn-reference")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup-bench", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="compare: bf16 runs trn-train --precision bf16 against torch.autocast bf16; "
                        "bench: bf16 trains under torch.autocast bf16")
    p.add_argument("--n-layer", type=int, default=0, help="override the preset's number of blocks")
    a = p.parse_args()
    c = dict(PRESETS[a.model])
    if a.n_layer > 0:
        c["n_layer"] = a.n_layer
    if a.mode == "bench":
        return bench(a, c)
    torch.set_num_threads(1)
    return compare(a, c)


if __name__ == "__main__":
    sys.exit(main())
