#!/usr/bin/python3
"""PyTorch reference for trn's GPT-2 (runs under the system interpreter, /usr/bin/python3).

compare: builds the model of DESIGN.md in PyTorch with Hugging Face GPT-2 names, saves its
initial weights as safetensors, runs `trn-train --init` on that file (which also dumps the
batches it trains on), trains the same steps on the same batches here, and checks that the
per-step losses agree to 1e-4 relative, the final weights to 1e-4 max-abs, and that trn's saved
file loads with load_state_dict(strict=True). Exits 1 on any mismatch.

compare --precision bf16: the same, with `trn-train --precision bf16` against trn's bf16 rounding
scheme written out in PyTorch fp32 arithmetic, with PyTorch fp32 and torch.autocast beside it;
the tolerance, and why it does not depend on the CPU, is explained at compare_bf16.

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


def round_bf16(t):
    """t rounded to the nearest bf16 (ties to even), held in fp32."""
    return t.to(torch.bfloat16).to(torch.float32)


class Bf16Matmul(torch.autograd.Function):
    """trn's --precision bf16 matmul, written out in fp32 arithmetic: y = bf16(x) bf16(w) (+ b).

    Backward rounds the output gradient to bf16 before both products, takes the weight gradient
    against the rounded input and the bias gradient from the unrounded output gradient, as
    runtime/kernels/bf16.h does. A product of two bf16 values is exact in fp32, so this differs
    from trn only in the order of fp32 sums, whichever kernels either side runs on this CPU.
    """

    @staticmethod
    def forward(ctx, x, w, b):
        xr, wr = round_bf16(x), round_bf16(w)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = b is not None
        return xr @ wr if b is None else torch.addmm(b, xr, wr)

    @staticmethod
    def backward(ctx, gy):
        xr, wr = ctx.saved_tensors
        gr = round_bf16(gy)
        return gr @ wr.t(), xr.t() @ gr, gy.sum(0) if ctx.has_bias else None


class RoundBf16(torch.autograd.Function):
    """Stores a value as bf16 (trn's q, k, v); the gradient passes through unrounded."""

    @staticmethod
    def forward(ctx, x):
        return round_bf16(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Bf16AttentionProducts(torch.autograd.Function):
    """trn's --precision bf16 attention after the scores (runtime/kernels/bf16.h): y = bf16(P) v from
    the fp32 probabilities P. Backward rounds the output gradient to bf16 for both its products
    (dP = bf16(gy) v^T, dv = bf16(P)^T bf16(gy)), and the scores' gradient dS = P (dP - rowsum(P dP))
    to bf16 before dS k and dS^T q. The score scale is applied inside this function (trn scales in
    the softmax), so the rounded dS is the gradient of the unscaled scores."""

    @staticmethod
    def forward(ctx, s, v, scale, mask):
        p = (s * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1)
        ctx.save_for_backward(p, v)
        ctx.scale = scale
        return round_bf16(p) @ v

    @staticmethod
    def backward(ctx, gy):
        p, v = ctx.saved_tensors
        gr = round_bf16(gy)
        dp = gr @ v.transpose(-2, -1)
        ds = round_bf16(p * (dp - (p * dp).sum(-1, keepdim=True)) * ctx.scale)
        return ds, round_bf16(p).transpose(-2, -1) @ gr, None, None


class Bf16Scores(torch.autograd.Function):
    """q k^T of bf16 q, k; the incoming gradient of the scores is already bf16 (Bf16AttentionProducts)."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        return q @ k.transpose(-2, -1)

    @staticmethod
    def backward(ctx, gs):
        q, k = ctx.saved_tensors
        return gs @ k, gs.transpose(-2, -1) @ q


class Conv1D(nn.Module):
    """A linear layer with the weight stored [in, out] (y = x W + b), as in GPT-2."""

    def __init__(self, n_in, n_out, bf16=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.bf16 = bf16

    def forward(self, x):
        shape = x.shape[:-1] + (self.weight.shape[1],)
        x2 = x.reshape(-1, x.shape[-1])
        if self.bf16:
            return Bf16Matmul.apply(x2, self.weight, self.bias).view(shape)
        return torch.addmm(self.bias, x2, self.weight).view(shape)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head = c["n_head"]
        self.bf16 = c.get("bf16", False)
        self.c_attn = Conv1D(c["d_model"], 3 * c["d_model"], self.bf16)
        self.c_proj = Conv1D(c["d_model"], c["d_model"], self.bf16)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        qkv = self.c_attn(x)
        if self.bf16:
            qkv = RoundBf16.apply(qkv)
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        if self.bf16:
            y = Bf16AttentionProducts.apply(Bf16Scores.apply(q, k), v, 1.0 / math.sqrt(hs), mask)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = Conv1D(c["d_model"], 4 * c["d_model"], c.get("bf16", False))
        self.c_proj = Conv1D(4 * c["d_model"], c["d_model"], c.get("bf16", False))

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
        self.bf16 = c.get("bf16", False)
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
        x = self.ln_f(x)
        if self.bf16:  # the LM head tied to wte, as a bf16 matmul
            logits = Bf16Matmul.apply(x.reshape(-1, x.shape[-1]), self.wte.weight.t(), None).view(
                x.shape[:-1] + (-1,))
        else:
            logits = x @ self.wte.weight.t()  # LM head tied to wte
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
    """trn-train --precision bf16 against the same rounding scheme written in PyTorch.

    The yardstick must not move with the CPU. torch.autocast's does: it rounds at other places
    than trn (every matmul's output and bias, the attention scores, GELU, each weight gradient),
    and on a CPU with AVX512-BF16 it takes oneDNN's native bf16 kernels, elsewhere others, so how
    far autocast lands from trn depends on the machine. Instead the model is built a third time
    with trn's bf16 scheme spelled out in fp32 arithmetic (Bf16Matmul, RoundBf16,
    Bf16AttentionProducts: the same operands rounded, the same gradients rounded). A product of two bf16 values is exact in fp32,
    so that model and trn (with either of its bf16 kernels, on any CPU) differ only in the order
    of fp32 sums. An order change still flips the odd bf16 rounding, and a flip upstream flips
    more downstream, so the two are two draws of the same rounding noise rather than equal
    numbers. Their distance is bounded by the noise, not by any kernel choice:
      per step   |trn bf16 - torch trn-scheme| <= 2^-9 loss   (half a bf16 rounding of the loss)
      per step   |trn bf16 - torch fp32|       <= 2e-2 loss   (bf16 tracks fp32, as bf16_test.cc)
      at the end max |w trn - w torch trn-scheme| <= 1e-3
    This holds where the training does not amplify noise: the caller ramps the learning rate over
    the whole run (reference_test.cc). With a spike in the loss, any two draws of the noise, fp32
    order changes included, land percents apart at the spike. Autocast's own distance from fp32
    is printed beside trn's for information only. Figures: bench/results/2026-12-01-bf16-reference-tolerance.md.
    """
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = GPT2(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_safetensors(init, model.state_dict())
    models = {"scheme": GPT2(dict(c, bf16=True)), "fp32": GPT2(c), "autocast": model}
    for m in models.values():
        m.load_state_dict(model.state_dict())
    # One trn run per kernel path asked for (--bf16-kernels, repeated), each in a folder of its
    # own; the PyTorch models train once, and every run is held to them.
    runs = {}
    for path in a.bf16_kernels or [""]:
        sub = argparse.Namespace(**dict(vars(a), workdir=os.path.join(a.workdir, path or "default")))
        os.makedirs(sub.workdir, exist_ok=True)
        got = run_trn(sub, init, ["--precision", "bf16"] + (["--bf16-kernels", path] if path else []))
        if got is None:
            return 1
        runs[path or "default"] = got
    batches = next(iter(runs.values()))[2]
    for path, (_, _, b) in runs.items():
        if open(b, "rb").read() != open(batches, "rb").read():
            print(f"FAIL: the {path} run trained on other batches than the {next(iter(runs))} run")
            return 1
    tokens = np.fromfile(batches, dtype="<i4").reshape(a.steps, a.batch_size, a.seq_len + 1)
    tokens = torch.from_numpy(tokens.astype(np.int64))
    opts = {k: make_optimizer(m, a) for k, m in models.items()}
    ok = True
    worst = {path: 0.0 for path in runs}
    worst32 = {path: 0.0 for path in runs}
    worst_auto = 0.0
    for s in range(a.steps):
        x, y = tokens[s, :, :-1], tokens[s, :, 1:]
        lr = lr_at(s, a)
        l = {k: train_step(m, opts[k], x, y, lr, a.grad_clip, autocast=(k == "autocast"))[0] for k, m in models.items()}
        worst_auto = max(worst_auto, abs(l["autocast"] - l["fp32"]) / abs(l["fp32"]))
        for path, (trn, _, _) in runs.items():
            lt = trn[s]["loss"]
            d, d32, dauto = (abs(lt - l[k]) / abs(l[k]) for k in ("scheme", "fp32", "autocast"))
            worst[path], worst32[path] = max(worst[path], d), max(worst32[path], d32)
            print(f"step {s + 1:3d}  trn bf16 ({path}) {lt:.6f}  torch trn-scheme {l['scheme']:.6f} (rel {d:.2e})  "
                  f"torch fp32 {l['fp32']:.6f} (rel {d32:.2e})  torch autocast {l['autocast']:.6f} (trn rel {dauto:.2e})")
            if d > 2.0 ** -9 or d32 > 2e-2:
                ok = False
    print(f"torch autocast vs torch fp32: worst relative difference {worst_auto:.2e} (information)")
    for path, (_, final, _) in runs.items():
        trained = load_safetensors(final)
        # The key bias (columns [C, 2C) of c_attn.bias) is left out: it adds q.b_k to a whole row of
        # scores, which the softmax ignores, so its exact gradient is 0 and each side's is the rounding
        # noise of a row of dS that sums to 0 only before dS is rounded to bf16. AdamW divides that
        # noise by its own magnitude and steps the bias by about lr either way, on each side
        # independently: a difference of noise, not of the scheme.
        worst_w, worst_name = 0.0, ""
        C = c["d_model"]
        for name, t in models["scheme"].state_dict().items():
            diff = (t - trained[name]).abs()
            if name.endswith("attn.c_attn.bias"):
                noise = diff[C:2 * C].max().item()
                diff = torch.cat([diff[:C], diff[2 * C:]])
                print(f"{path}: {name}: key bias max-abs difference {noise:.2e} (not compared: a zero gradient's "
                      f"rounding noise)")
            dw = diff.max().item()
            if dw > worst_w:
                worst_w, worst_name = dw, name
        print(f"{path}: losses: worst relative difference trn bf16 vs torch trn-scheme {worst[path]:.2e} (limit 2^-9), "
              f"vs torch fp32 {worst32[path]:.2e} (limit 2e-2)")
        print(f"{path}: final weights: worst max-abs difference from torch trn-scheme {worst_w:.2e} in {worst_name} "
              f"(limit 1e-3)")
        if worst_w > 1e-3:
            ok = False
        GPT2(c).load_state_dict(trained, strict=True)  # the fp32 master, as always
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def bench(a, c, model_class=None):
    """Trains model_class(c) (GPT2 unless given) on random tokens; prints tokens/s and peak RSS."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = (model_class or GPT2)(c)
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
    p.add_argument("--bf16-kernels", action="append", default=[], choices=["auto", "emulated", "onednn"],
                   help="compare --precision bf16: force trn's bf16 kernel path; repeated, one trn run per path, "
                        "each held to the same PyTorch runs")
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
