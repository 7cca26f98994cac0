#!/usr/bin/python3
"""PyTorch reference for trn's Llama family (runs under the system interpreter, /usr/bin/python3).

The model is Hugging Face's LlamaForCausalLM written out (the transformers package is not used):
the same module tree, so the same state-dict names and shapes (nn.Linear weights [out, in], no
biases), RMSNorm with its statistics in fp32, RoPE in the rotate-half convention, SwiGLU, and
grouped-query attention with the KV heads repeated the HF way (repeat_kv), causal attention
written out. The contract it checks trn against is /work/notes/llama-spec.md (the Llama spec).

compare: builds the model, saves its initial weights as safetensors, runs `trn-train --arch llama
--init` on that file (which also dumps the batches it trains on), trains the same steps on the
same batches here with torch.optim.AdamW, and checks that the per-step losses agree to 1e-4
relative, the final weights to 1e-4 max-abs, that trn's saved file carries the configuration in
its metadata and loads with load_state_dict(strict=True). Exits 1 on any mismatch.

compare --precision bf16: the same against trn's bf16 rounding scheme written out in PyTorch fp32
arithmetic (gpt2_reference.compare_bf16 explains the scheme and its tolerance).

diagnose: one step of trn and of the reference with the gradient clipped far below AdamW's eps,
so that each weight's update is proportional to its gradient; prints each tensor's relative
gradient difference in model order and names the first that disagrees.

selftest: checks the reference against itself and against independent naive implementations
(numpy, float64): the spec's names and shapes, RMSNorm, RoPE as a complex rotation, the whole
forward, GQA against multi-head attention, gradients with torch.autograd.gradcheck, causality,
the safetensors round trip and the optimizer's decay groups. Needs no trn.

bench: trains on random tokens and prints tokens/s and peak RSS (for bench/llama.py).
"""
import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_reference import bench as gpt2_bench  # noqa: E402
from gpt2_reference import (Bf16Matmul, RoundBf16, load_safetensors, lr_at, make_optimizer,  # noqa: E402
                            save_safetensors, train_step)

PRESETS = {
    "llama-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=128, ffn_dim=384, ctx=128, vocab=256,
                       rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama-small": dict(n_layer=4, n_head=8, n_kv_head=4, d_model=256, ffn_dim=768, ctx=256, vocab=256,
                        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "llama-3.2-1b": dict(n_layer=16, n_head=32, n_kv_head=8, d_model=2048, ffn_dim=8192, ctx=131072,
                         vocab=128256, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True),
}


def head_dim(c):
    """An explicit head_dim (Hugging Face's config field), else d_model / n_head."""
    return c.get("head_dim") or c["d_model"] // c["n_head"]


def spec_tensors(c):
    """The spec's tensor table: HF name -> global shape, in model order."""
    C, F_, V, L = c["d_model"], c["ffn_dim"], c["vocab"], c["n_layer"]
    hd = head_dim(c)
    H, K = c["n_head"], c["n_kv_head"]
    out = {"model.embed_tokens.weight": [V, C]}
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = [C]
        out[p + "self_attn.q_proj.weight"] = [H * hd, C]
        out[p + "self_attn.k_proj.weight"] = [K * hd, C]
        out[p + "self_attn.v_proj.weight"] = [K * hd, C]
        if c.get("qkv_bias"):  # Qwen2
            out[p + "self_attn.q_proj.bias"] = [H * hd]
            out[p + "self_attn.k_proj.bias"] = [K * hd]
            out[p + "self_attn.v_proj.bias"] = [K * hd]
        out[p + "self_attn.o_proj.weight"] = [C, H * hd]
        out[p + "post_attention_layernorm.weight"] = [C]
        out[p + "mlp.gate_proj.weight"] = [F_, C]
        out[p + "mlp.up_proj.weight"] = [F_, C]
        out[p + "mlp.down_proj.weight"] = [C, F_]
    out["model.norm.weight"] = [C]
    if not c["tie_embeddings"]:
        out["lm_head.weight"] = [V, C]
    return out


def number(v):
    """A double as trn's describe() writes it (fmt's shortest form: Python's repr without ".0")."""
    r = repr(float(v))
    return r[:-2] if r.endswith(".0") else r


def describe(c):
    """The config as trn writes it in the saved file's "trn.model" metadata (the spec's example)."""
    out = (f"arch=llama n_layer={c['n_layer']} n_head={c['n_head']} n_kv_head={c['n_kv_head']} "
           f"d_model={c['d_model']} ffn_dim={c['ffn_dim']} ctx={c['ctx']} vocab={c['vocab']} "
           f"rope_theta={number(c['rope_theta'])} norm_eps={number(c['norm_eps'])} "
           f"tie_embeddings={int(c['tie_embeddings'])}")
    # The optional fields, only where they differ from trn's defaults, in trn's order.
    if c.get("head_dim"):
        out += f" head_dim={c['head_dim']}"
    if c.get("qkv_bias"):
        out += " qkv_bias=1"
    r = c.get("rope_scaling")
    if r:
        for key, default in (("factor", 0), ("low_freq_factor", 1), ("high_freq_factor", 4)):
            if r[key] != default:
                out += f" rope_{key}={number(r[key])}"
        if r["original_max_position_embeddings"] != 8192:
            out += f" rope_original_ctx={r['original_max_position_embeddings']}"
    return out


class Linear(nn.Linear):
    """nn.Linear (weight [out, in], y = x W^T (+ b)), without bias unless asked (Qwen2's q, k, v);
    bf16: trn's bf16 matmul scheme, the bias added in fp32."""

    def __init__(self, n_in, n_out, bf16=False, device=None, bias=False):
        super().__init__(n_in, n_out, bias=bias, device=device)
        self.bf16 = bf16

    def forward(self, x):
        if not self.bf16:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape[:-1] + (self.weight.shape[0],)
        y = Bf16Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight.t(), None).view(shape)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) computed in (at least) fp32, times the weight."""

    def __init__(self, n, eps, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, device=device))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def llama3_inv_freq(inv_freq, r):
    """transformers' rope_type "llama3" (Llama-3.1, 3.2): frequencies of wavelength above
    original_max_position_embeddings / low_freq_factor divided by factor, below
    original / high_freq_factor kept, between them interpolated (written here from the formula)."""
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old = r["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(T, hd, theta, dtype, scaling=None):
    """cos and sin (T, hd) of HF's rotary embedding: inv_freq[i] = theta^(-2i/hd) (llama3-scaled
    when asked), angle t*inv_freq, each angle twice ([freqs | freqs]). Computed in float64 and
    rounded once to dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if scaling:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(u, cos, sin):
    """u (B, heads, T, hd): out[i] = u[i] cos - u[i+half] sin, out[i+half] = u[i+half] cos + u[i] sin."""
    cos, sin = cos.to(u.dtype), sin.to(u.dtype)
    return u * cos + rotate_half(u) * sin


def repeat_kv(x, n_rep):
    """HF's repeat_kv: (B, K, T, hd) -> (B, K*n_rep, T, hd), query head h reading KV head h // n_rep."""
    B, K, T, hd = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, K, n_rep, T, hd).reshape(B, K * n_rep, T, hd)


class Attention(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        C, H, K = c["d_model"], c["n_head"], c["n_kv_head"]
        assert H % K == 0, "n_kv_head must divide n_head"
        self.H, self.K, self.hd = H, K, head_dim(c)
        self.bf16 = c.get("bf16", False)
        bias = bool(c.get("qkv_bias"))
        self.q_proj = Linear(C, H * self.hd, self.bf16, device, bias)
        self.k_proj = Linear(C, K * self.hd, self.bf16, device, bias)
        self.v_proj = Linear(C, K * self.hd, self.bf16, device, bias)
        self.o_proj = Linear(H * self.hd, C, self.bf16, device)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.K, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.K, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.bf16:  # trn stores q (after RoPE), k (after RoPE) and v as bf16 for attention
            q, k, v = RoundBf16.apply(q), RoundBf16.apply(k), RoundBf16.apply(v)
        k, v = repeat_kv(k, self.H // self.K), repeat_kv(v, self.H // self.K)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = att.softmax(dim=-1, dtype=torch.promote_types(att.dtype, torch.float32)).to(q.dtype)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, self.H * self.hd)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        C, F_, bf16 = c["d_model"], c["ffn_dim"], c.get("bf16", False)
        self.gate_proj = Linear(C, F_, bf16, device)
        self.up_proj = Linear(C, F_, bf16, device)
        self.down_proj = Linear(F_, C, bf16, device)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.self_attn = Attention(c, device)
        self.mlp = MLP(c, device)
        self.input_layernorm = RMSNorm(c["d_model"], c["norm_eps"], device)
        self.post_attention_layernorm = RMSNorm(c["d_model"], c["norm_eps"], device)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["d_model"], device=device)
        self.layers = nn.ModuleList([DecoderLayer(c, device) for _ in range(c["n_layer"])])
        self.norm = RMSNorm(c["d_model"], c["norm_eps"], device)


class Llama(nn.Module):
    """LlamaForCausalLM: .model (embed_tokens, layers, norm) and lm_head, absent when tied."""

    def __init__(self, c, device=None):
        super().__init__()
        self.c = c
        self.bf16 = c.get("bf16", False)
        self.model = LlamaModel(c, device)
        self.lm_head = None if c["tie_embeddings"] else Linear(c["d_model"], c["vocab"], self.bf16, device)
        proj_std = 0.02 / math.sqrt(2 * c["n_layer"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.normal_(0.0, proj_std)
                else:
                    p.normal_(0.0, 0.02)

    def logits(self, idx, rope=True):
        T = idx.shape[1]
        x = self.model.embed_tokens(idx)
        hd = head_dim(self.c)
        if rope:
            cos, sin = rope_tables(T, hd, self.c["rope_theta"], x.dtype, self.c.get("rope_scaling"))
        else:  # rotation by angle 0 (selftest: attention without positions)
            cos, sin = torch.ones(T, hd, dtype=x.dtype), torch.zeros(T, hd, dtype=x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x)
        w = self.model.embed_tokens.weight  # the head tied to the embedding
        if self.bf16:
            return Bf16Matmul.apply(x.reshape(-1, x.shape[-1]), w.t(), None).view(x.shape[:-1] + (-1,))
        return F.linear(x, w)

    def forward(self, idx, targets):
        logits = self.logits(idx)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# compare against trn-train


def config_from(a):
    c = dict(PRESETS[a.model])
    if a.n_layer > 0:
        c["n_layer"] = a.n_layer
    if a.n_kv_head > 0:
        c["n_kv_head"] = a.n_kv_head
    if a.tie_embeddings >= 0:
        c["tie_embeddings"] = bool(a.tie_embeddings)
    # Hugging Face models' fields (trn takes them from the --init file's metadata: --shape-from-init).
    if a.head_dim > 0:
        c["head_dim"] = a.head_dim
    if a.qkv_bias:
        c["qkv_bias"] = True
    if a.rope_factor > 0:
        c["rope_scaling"] = dict(factor=a.rope_factor, low_freq_factor=a.rope_low_freq_factor,
                                 high_freq_factor=a.rope_high_freq_factor,
                                 original_max_position_embeddings=a.rope_original_ctx)
    if (a.head_dim > 0 or a.qkv_bias or a.rope_factor > 0) and not a.shape_from_init:
        sys.exit("--head-dim, --qkv-bias and --rope-factor need --shape-from-init (trn reads them from the file)")
    return c


def trn_command(a, init, workdir, extra=()):
    """trn-train (under trnrun for --tp/--pp > 1) from init on a's settings, as gpt2_reference drives it."""
    metrics, final, batches = (os.path.join(workdir, n) for n in ("metrics.jsonl", "final.safetensors", "batches.bin"))
    shape = [] if a.shape_from_init else ["--arch", "llama", "--model", a.model]
    cmd = [a.trn_train] + shape + ["--init", init, "--steps", str(a.steps),
           "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr),
           "--lr-schedule", a.lr_schedule, "--warmup-steps", str(a.warmup_steps), "--min-lr", str(a.min_lr),
           "--weight-decay", str(a.weight_decay), "--beta1", str(a.beta1), "--beta2", str(a.beta2),
           "--grad-clip", str(a.grad_clip), "--seed", str(a.seed), "--threads", str(a.threads),
           "--metrics-jsonl", metrics, "--save", final, "--dump-batches", batches, "--log-every", "5"]
    if a.n_layer > 0 and shape:
        cmd += ["--n-layer", str(a.n_layer)]
    if a.n_kv_head > 0 and shape:
        cmd += ["--n-kv-head", str(a.n_kv_head)]
    if a.tie_embeddings >= 0 and shape:
        cmd += ["--tie-embeddings", str(a.tie_embeddings)]
    cmd += list(extra)
    if a.tp * a.pp > 1:  # a tensor- and pipeline-parallel job of tp x pp workers on this node
        cmd = [a.trnrun, "--nproc-per-node", str(a.tp * a.pp), "--"] + cmd + ["--tp", str(a.tp), "--pp", str(a.pp)]
        if a.pp > 1:
            cmd += ["--micro-batches", str(a.batch_size)]
    return cmd, metrics, final, batches


def run_trn(a, init, workdir, extra=()):
    """Runs trn-train; returns (per-step metrics, saved file, batches (steps, B, T+1) int64) or None."""
    cmd, metrics, final, batches = trn_command(a, init, workdir, extra)
    print("$ " + " ".join(cmd))
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout)
        print(f"FAIL: trn-train exited {run.returncode}")
        return None
    for line in run.stdout.splitlines():
        if "precision bf16" in line:
            print(line.split("] ", 1)[-1])
    trn = [json.loads(line) for line in open(metrics)]
    tokens = np.fromfile(batches, dtype="<i4").reshape(a.steps, a.batch_size, a.seq_len + 1)
    return trn, final, torch.from_numpy(tokens.astype(np.int64))


def save_init(path, model, c, shape_from_init):
    """The initial weights; with shape_from_init, the configuration in the metadata as trn's --save writes it."""
    save_safetensors(path, model.state_dict())
    if not shape_from_init:
        return
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["__metadata__"] = {"format": "pt", "trn.model": describe(c), "trn.steps": "0"}
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text.encode() + raw[8 + n:])


def safetensors_metadata(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return header.get("__metadata__", {}), {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def check_saved_file(path, c, steps):
    """The saved file's metadata and dtypes as the spec has them; returns a list of problems."""
    meta, dtypes = safetensors_metadata(path)
    bad = [f"{k}: dtype {d}" for k, d in dtypes.items() if d != "F32"]
    if meta.get("format") != "pt":
        bad.append(f'__metadata__ format is {meta.get("format")!r}, not "pt"')
    got = dict(kv.split("=", 1) for kv in meta.get("trn.model", "").split() if "=" in kv)
    want = dict(kv.split("=", 1) for kv in describe(c).split())
    for k, v in want.items():
        g = got.get(k)
        same = g is not None and (float(g) == float(v) if k in ("rope_theta", "norm_eps") else g == v)
        if not same:
            bad.append(f'trn.model {k}={g} (want {v}; metadata "{meta.get("trn.model")}")')
    if str(meta.get("trn.steps")) != str(steps):
        bad.append(f"trn.steps {meta.get('trn.steps')!r} (want {steps})")
    return bad


def weight_diffs(model, trained):
    """(max-abs difference, name) of every tensor, in the order the forward reads them (the spec's)."""
    sd = model.state_dict()
    return [((sd[name] - trained[name]).abs().max().item(), name) for name in spec_tensors(model.c)]


def compare(a, c):
    if a.precision == "bf16":
        return compare_bf16(a, c)
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = Llama(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_init(init, model, c, a.shape_from_init)
    got = run_trn(a, init, a.workdir)
    if got is None:
        return 1
    trn, final, tokens = got
    opt = make_optimizer(model, a)
    ok = True
    worst_loss, worst_norm, first_bad = 0.0, 0.0, 0
    for s in range(a.steps):
        loss, norm = train_step(model, opt, tokens[s, :, :-1], tokens[s, :, 1:], lr_at(s, a), a.grad_clip)
        rel = abs(loss - trn[s]["loss"]) / abs(loss)
        worst_loss = max(worst_loss, rel)
        worst_norm = max(worst_norm, abs(norm - trn[s]["grad_norm"]) / norm)
        print(f"step {s + 1:3d}  torch loss {loss:.6f}  trn loss {trn[s]['loss']:.6f}  rel {rel:.2e}  "
              f"grad norm torch {norm:.5f} trn {trn[s]['grad_norm']:.5f}")
        if rel > 1e-4:
            ok = False
            first_bad = first_bad or s + 1
    trained = load_safetensors(final)
    missing = sorted(set(model.state_dict()) - set(trained))
    extra = sorted(set(trained) - set(model.state_dict()))
    if missing or extra:
        print(f"FAIL: trn's saved file lacks {missing} and has unexpected {extra}")
        return 1
    diffs = weight_diffs(model, trained)
    worst_w, worst_name = max(diffs)
    print(f"losses: worst relative difference {worst_loss:.2e} (limit 1e-4)"
          + (f", first over the limit at step {first_bad}" if first_bad else "")
          + f"; gradient norms: worst relative difference {worst_norm:.2e} (information: AdamW hides a gradient's "
          "scale from the losses; `diagnose` compares each tensor's gradient)")
    print(f"final weights: worst max-abs difference {worst_w:.2e} in {worst_name} (limit 1e-4)")
    over = [(d, n) for d, n in diffs if d > 1e-4]
    if over:
        print(f"final weights over the limit ({len(over)} of {len(diffs)} tensors; model order): "
              + ", ".join(f"{n} {d:.2e}" for d, n in over[:8]))
    problems = check_saved_file(final, c, a.steps)
    for p in problems:
        print(f"saved file: {p}")
    fresh = Llama(c)
    fresh.load_state_dict(trained, strict=True)  # raises on a missing or unexpected key or shape
    with torch.no_grad():
        l_trn = fresh(tokens[0, :, :-1], tokens[0, :, 1:]).item()
        l_torch = model(tokens[0, :, :-1], tokens[0, :, 1:]).item()
    print(f"trn-saved weights loaded with strict=True: loss {l_trn:.6f} vs torch-trained {l_torch:.6f}")
    if worst_w > 1e-4 or abs(l_trn - l_torch) > 1e-4 * abs(l_torch) or problems:
        ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def compare_bf16(a, c):
    """trn-train --precision bf16 against trn's bf16 scheme written out in PyTorch fp32 arithmetic.

    The scheme (Linear and the tied head with bf16=True, q and k after RoPE and v stored as bf16)
    and the tolerances are GPT-2's (gpt2_reference.compare_bf16 says why they hold on any CPU):
    per step |trn - scheme| <= 2^-9 loss, |trn - fp32| <= 2e-2 loss, final weights within 1e-3 of
    the scheme, under a learning rate ramped over the whole run. torch.autocast is printed beside
    for information only. The weight limit is nearest to being reached by the embedding rows of
    rare tokens when the head is untied: such a row's gradient is a sum of a few rows of the
    input gradient, AdamW scales its small entries up to about lr per step, so a rounding that
    flips one of them moves the weight by that much, with no head gradient to outweigh it.
    """
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = Llama(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_init(init, model, c, a.shape_from_init)
    models = {"scheme": Llama(dict(c, bf16=True)), "fp32": Llama(c), "autocast": model}
    for m in models.values():
        m.load_state_dict(model.state_dict())
    got = run_trn(a, init, a.workdir,
                  ["--precision", "bf16"] + (["--bf16-kernels", a.bf16_kernels] if a.bf16_kernels else []))
    if got is None:
        return 1
    trn, final, tokens = got
    opts = {k: make_optimizer(m, a) for k, m in models.items()}
    ok = True
    worst = worst32 = worst_auto = 0.0
    for s in range(a.steps):
        x, y = tokens[s, :, :-1], tokens[s, :, 1:]
        lr = lr_at(s, a)
        l = {k: train_step(m, opts[k], x, y, lr, a.grad_clip, autocast=(k == "autocast"))[0] for k, m in models.items()}
        lt = trn[s]["loss"]
        d, d32 = (abs(lt - l[k]) / abs(l[k]) for k in ("scheme", "fp32"))
        dauto = abs(lt - l["autocast"]) / abs(l["autocast"])
        worst, worst32 = max(worst, d), max(worst32, d32)
        worst_auto = max(worst_auto, abs(l["autocast"] - l["fp32"]) / abs(l["fp32"]))
        print(f"step {s + 1:3d}  trn bf16 {lt:.6f}  torch trn-scheme {l['scheme']:.6f} (rel {d:.2e})  "
              f"torch fp32 {l['fp32']:.6f} (rel {d32:.2e})  torch autocast {l['autocast']:.6f} (trn rel {dauto:.2e})")
        if d > 2.0 ** -9 or d32 > 2e-2:
            ok = False
    trained = load_safetensors(final)
    worst_w, worst_name = max(weight_diffs(models["scheme"], trained))
    print(f"losses: worst relative difference trn bf16 vs torch trn-scheme {worst:.2e} (limit 2^-9), "
          f"vs torch fp32 {worst32:.2e} (limit 2e-2); torch autocast vs torch fp32 {worst_auto:.2e} (information)")
    print(f"final weights: worst max-abs difference from torch trn-scheme {worst_w:.2e} in {worst_name} (limit 1e-3)")
    if worst_w > 1e-3:
        ok = False
    fresh = Llama(c)
    fresh.load_state_dict(trained, strict=True)  # the fp32 master, as always
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def diagnose(a, c):
    """Which tensor's gradient disagrees first, in model order.

    One step of each side with the gradient norm clipped to 1e-12, far below AdamW's eps (1e-8),
    no weight decay and a constant learning rate: then each update is -lr g'/(|g'| + eps) with g'
    the clipped gradient, nearly -lr g'/eps, so (w0 - w1) eps / lr recovers g' on both sides and
    the ratio of their difference to its size measures each tensor's gradient (lr 1e4 lifts the
    updates far above the fp32 spacing of the weights).
    """
    os.makedirs(a.workdir, exist_ok=True)
    a.steps, a.lr, a.lr_schedule, a.warmup_steps, a.weight_decay, a.grad_clip = 1, 1e4, "constant", 0, 0.0, 1e-12
    torch.manual_seed(a.seed)
    model = Llama(c)
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    init = os.path.join(a.workdir, "init.safetensors")
    save_init(init, model, c, a.shape_from_init)
    got = run_trn(a, init, a.workdir)
    if got is None:
        return 1
    trn, final, tokens = got
    opt = make_optimizer(model, a)
    loss, norm = train_step(model, opt, tokens[0, :, :-1], tokens[0, :, 1:], a.lr, a.grad_clip)
    print(f"step 1 loss torch {loss:.6f} trn {trn[0]['loss']:.6f} (rel {abs(loss - trn[0]['loss']) / loss:.2e}); "
          f"grad norm torch {norm:.6f} trn {trn[0]['grad_norm']:.6f}")
    trained = load_safetensors(final)
    differ = []
    sd = model.state_dict()
    for name in spec_tensors(c):  # in the order the forward reads them
        w = sd[name]
        g_torch, g_trn = w0[name] - w, w0[name] - trained[name]
        scale = g_torch.abs().max().item()
        rel = (g_torch - g_trn).abs().max().item() / max(scale, 1e-30)
        flag = "  <-- differs" if rel > 1e-3 else ""
        print(f"{name:48s} {str(list(w.shape)):14s} update max {scale:.3e}  rel diff {rel:.2e}{flag}")
        if flag:
            differ.append(name)
    if not differ:
        print("all gradients agree (rel <= 1e-3)")
        return 0
    # the backward runs the forward's order in reverse: its first wrong gradient is the last listed
    print(f"gradients differ (rel > 1e-3) in {len(differ)} tensors: first in the forward's order {differ[0]}, "
          f"first the backward reaches {differ[-1]}")
    return 1


# ---------------------------------------------------------------------------------------------
# selftest: the reference against independent naive implementations


def naive_rmsnorm(x, w, eps):
    """x (N, C) float64 numpy, row by row."""
    out = np.empty_like(x)
    for n in range(x.shape[0]):
        out[n] = x[n] / math.sqrt(sum(v * v for v in x[n]) / x.shape[1] + eps) * w
    return out


def naive_rope(u, t, theta):
    """u (hd,) at position t: the pairs (u[i], u[i+half]) as complex numbers rotated by t theta^(-2i/hd)."""
    hd = u.shape[0]
    half = hd // 2
    z = (u[:half] + 1j * u[half:]) * np.exp(1j * t * theta ** (-2.0 * np.arange(half) / hd))
    return np.concatenate([z.real, z.imag])


def naive_loss(sd, c, idx, targets):
    """The whole model in float64 numpy, one position and one head at a time; mean cross-entropy."""
    sd = {k: v.detach().double().numpy() for k, v in sd.items()}
    C, H, K, eps = c["d_model"], c["n_head"], c["n_kv_head"], c["norm_eps"]
    hd, group = C // H, H // K
    total, count = 0.0, 0
    for b in range(idx.shape[0]):
        T = idx.shape[1]
        x = sd["model.embed_tokens.weight"][idx[b].numpy()]  # (T, C)
        for i in range(c["n_layer"]):
            p = f"model.layers.{i}."
            h = naive_rmsnorm(x, sd[p + "input_layernorm.weight"], eps)
            q = h @ sd[p + "self_attn.q_proj.weight"].T
            k = h @ sd[p + "self_attn.k_proj.weight"].T
            v = h @ sd[p + "self_attn.v_proj.weight"].T
            y = np.zeros((T, H * hd))
            for head in range(H):
                kv = head // group
                qs = np.stack([naive_rope(q[t, head * hd:(head + 1) * hd], t, c["rope_theta"]) for t in range(T)])
                ks = np.stack([naive_rope(k[t, kv * hd:(kv + 1) * hd], t, c["rope_theta"]) for t in range(T)])
                vs = v[:, kv * hd:(kv + 1) * hd]
                for t in range(T):
                    s = np.array([qs[t] @ ks[u] / math.sqrt(hd) for u in range(t + 1)])
                    e = np.exp(s - s.max())
                    y[t, head * hd:(head + 1) * hd] = (e / e.sum()) @ vs[:t + 1]
            x = x + y @ sd[p + "self_attn.o_proj.weight"].T
            h2 = naive_rmsnorm(x, sd[p + "post_attention_layernorm.weight"], eps)
            g = h2 @ sd[p + "mlp.gate_proj.weight"].T
            up = h2 @ sd[p + "mlp.up_proj.weight"].T
            x = x + (g / (1.0 + np.exp(-g)) * up) @ sd[p + "mlp.down_proj.weight"].T
        x = naive_rmsnorm(x, sd["model.norm.weight"], eps)
        head_w = sd["model.embed_tokens.weight"] if c["tie_embeddings"] else sd["lm_head.weight"]
        logits = x @ head_w.T
        for t in range(T):
            m = logits[t].max()
            total += m + math.log(np.exp(logits[t] - m).sum()) - logits[t, targets[b, t].item()]
            count += 1
    return total / count


class Checks:
    def __init__(self):
        self.failed = 0

    def __call__(self, ok, what):
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
        self.failed += 0 if ok else 1


def random_norm_weights(model, g):
    """Norm weights away from 1 so that a test sees whether they are applied."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def selftest(a):
    torch.set_num_threads(1)
    check = Checks()
    g = torch.Generator().manual_seed(7)

    # 1. names and shapes are exactly the spec's, in every preset and variant
    for name in ("llama-tiny", "llama-small"):
        for variant in ({}, {"tie_embeddings": True}, {"n_kv_head": 1}, {"n_kv_head": PRESETS[name]["n_head"]}):
            c = dict(PRESETS[name], **variant)
            got = {k: list(v.shape) for k, v in Llama(c).state_dict().items()}
            want = spec_tensors(c)
            check(got == want, f"{name} {variant or ''}: state dict names and shapes = spec ({len(want)} tensors)")
    c = PRESETS["llama-3.2-1b"]
    got = {k: list(v.shape) for k, v in Llama(c, device="meta").state_dict().items()}
    n = sum(math.prod(s) for s in got.values())
    check(got == spec_tensors(c), f"llama-3.2-1b (meta device): state dict = spec, {n / 1e9:.3f}B parameters")

    # 2. init: N(0, 0.02), o/down N(0, 0.02/sqrt(2L)), norms 1
    c = PRESETS["llama-small"]
    torch.manual_seed(1)
    m = Llama(c)
    proj = 0.02 / math.sqrt(2 * c["n_layer"])
    ok = True
    for k, v in m.state_dict().items():
        want = 1.0 if v.dim() == 1 else (proj if k.endswith(("o_proj.weight", "down_proj.weight")) else 0.02)
        if v.dim() == 1:
            ok &= bool((v == 1).all())
        else:
            ok &= abs(v.std().item() - want) < 0.05 * want and abs(v.mean().item()) < 0.05 * want
    check(ok, "init: embed/q/k/v/gate/up/lm_head std 0.02, o/down std 0.02/sqrt(2L), norms 1")

    # 3. RMSNorm against a row-by-row float64 computation, and its statistics in fp32 under bf16 input
    x = torch.randn(5, 48, generator=g, dtype=torch.float64) * 3
    norm = RMSNorm(48, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g, dtype=torch.float64) + 0.5)
        got = norm(x).numpy()
    want = naive_rmsnorm(x.numpy(), norm.weight.detach().numpy(), 1e-5)
    check(np.abs(got - want).max() < 1e-12, f"RMSNorm = naive (max diff {np.abs(got - want).max():.1e})")
    # bf16 input (autocast): statistics in fp32, the normalised value rounded to bf16 (HF's .to(input_dtype))
    xb = (torch.randn(3, 64, generator=g) * 100).to(torch.bfloat16)
    got = RMSNorm(64, 1e-5)(xb).detach().double().numpy()
    want = naive_rmsnorm(xb.double().numpy(), np.ones(64), 1e-5)
    check(np.abs(got - want).max() <= 2.0 ** -8 * np.abs(want).max(),
          "RMSNorm of bf16 input = naive to bf16 rounding (fp32 statistics)")

    # 4. RoPE against a complex rotation, at every position, for two thetas
    for theta in (10000.0, 500000.0):
        T, hd = 37, 16
        u = torch.randn(1, 3, T, hd, generator=g, dtype=torch.float64)
        cos, sin = rope_tables(T, hd, theta, torch.float64)
        got = apply_rope(u, cos, sin).numpy()
        want = np.stack([[naive_rope(u[0, h, t].numpy(), t, theta) for t in range(T)] for h in range(3)])[None]
        d = np.abs(got - want).max()
        check(d < 1e-12, f"RoPE theta {theta:g} = complex rotation (max diff {d:.1e})")
    check(torch.allclose(apply_rope(u, cos, sin).norm(dim=-1), u.norm(dim=-1)), "RoPE keeps each head vector's norm")
    # relative position: <rope(q, t), rope(k, s)> depends on t - s only
    q0, k0 = torch.randn(hd, generator=g, dtype=torch.float64), torch.randn(hd, generator=g, dtype=torch.float64)
    cos, sin = rope_tables(40, hd, 10000.0, torch.float64)
    qr, kr = apply_rope(q0.expand(1, 1, 40, hd), cos, sin)[0, 0], apply_rope(k0.expand(1, 1, 40, hd), cos, sin)[0, 0]
    dots = [(qr[t] @ kr[t - 3]).item() for t in range(3, 40)]
    check(max(dots) - min(dots) < 1e-10, "RoPE: q.k depends on the relative position only")

    # 5. the whole forward against the naive float64 model, GQA (K = 2, 1, H), tied and untied
    small = dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_dim=48, ctx=16, vocab=40,
                 rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)
    for variant in ({}, {"n_kv_head": 1}, {"n_kv_head": 4}, {"tie_embeddings": True}):
        c = dict(small, **variant)
        torch.manual_seed(3)
        m = Llama(c).double()
        random_norm_weights(m, g)
        idx = torch.randint(0, c["vocab"], (2, 9), generator=g)
        tgt = torch.randint(0, c["vocab"], (2, 9), generator=g)
        with torch.no_grad():
            got = m(idx, tgt).item()
            got32 = Llama(c).float()
            got32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
            got32 = got32(idx, tgt).item()
        want = naive_loss(m.state_dict(), c, idx, tgt)
        check(abs(got - want) < 1e-12 and abs(got32 - want) < 1e-5 * want,
              f"forward {variant or 'K=2 untied'} = naive float64 model "
              f"(double {abs(got - want):.1e}, fp32 {abs(got32 - want):.1e})")

    # 6. K == H is plain multi-head attention: gpt2_reference's Attention with the same weights, RoPE off
    import gpt2_reference
    c = dict(small, n_kv_head=4)
    torch.manual_seed(4)
    attn = Attention(c).double()
    mha = gpt2_reference.Attention({"n_head": 4, "d_model": 32}).double()
    with torch.no_grad():
        mha.c_attn.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).t())
        mha.c_attn.bias.zero_()
        mha.c_proj.weight.copy_(attn.o_proj.weight.t())
        mha.c_proj.bias.zero_()
        x = torch.randn(2, 11, 32, generator=g, dtype=torch.float64)
        ones, zeros = torch.ones(11, 8, dtype=torch.float64), torch.zeros(11, 8, dtype=torch.float64)
        d = (attn(x, ones, zeros) - mha(x)).abs().max().item()
    check(d < 1e-12, f"attention with n_kv_head = n_head and no rotation = gpt2_reference.Attention (max diff {d:.1e})")

    # 7. GQA = multi-head attention whose K and V heads are copies: K=2 and K=1 against K=H models
    for K in (2, 1):
        c = dict(small, n_kv_head=K)
        torch.manual_seed(5)
        m = Llama(c).double()
        full = Llama(dict(small, n_kv_head=4)).double()
        sd = m.state_dict()
        hd, rep = 8, 4 // K
        for i in range(c["n_layer"]):
            for w in ("k_proj", "v_proj"):
                key = f"model.layers.{i}.self_attn.{w}.weight"
                sd[key] = sd[key].view(K, hd, -1).repeat_interleave(rep, dim=0).reshape(4 * hd, -1)
        full.load_state_dict(sd)
        idx = torch.randint(0, c["vocab"], (2, 12), generator=g)
        with torch.no_grad():
            d = (m.logits(idx) - full.logits(idx)).abs().max().item()
        check(d < 1e-12, f"GQA K={K} = MHA with KV head h/{rep} copied to query head h (max diff {d:.1e})")

    # 8. gradients: torch.autograd.gradcheck in double, of the parameters and of the pieces
    from torch.nn.utils.stateless import functional_call
    for variant in ({}, {"tie_embeddings": True}, {"n_kv_head": 1}):
        c = dict(small, n_layer=1, d_model=16, ffn_dim=24, vocab=20, **variant)
        torch.manual_seed(6)
        m = Llama(c).double()
        random_norm_weights(m, g)
        names = [k for k, _ in m.named_parameters()]
        params = tuple(p.detach().clone().requires_grad_(True) for _, p in m.named_parameters())
        idx = torch.randint(0, c["vocab"], (2, 5), generator=g)
        tgt = torch.randint(0, c["vocab"], (2, 5), generator=g)
        ok = torch.autograd.gradcheck(lambda *ps: functional_call(m, dict(zip(names, ps)), (idx, tgt)), params,
                                      eps=1e-6, atol=1e-7, rtol=1e-5)
        n = sum(p.numel() for p in params)
        check(ok, f"gradcheck (double) of the loss over all {n} parameters, {variant or 'K=2 untied'}")
    x = torch.randn(3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    check(torch.autograd.gradcheck(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, (x, w))
          and torch.autograd.gradcheck(lambda x: RMSNorm(8, 1e-5).double()(x), (x,)), "gradcheck RMSNorm")
    u = torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(7, 8, 10000.0, torch.float64)
    check(torch.autograd.gradcheck(lambda u: apply_rope(u, cos, sin), (u,)), "gradcheck RoPE")

    # 9. causality: a later token changes no earlier logit
    c = dict(small)
    torch.manual_seed(8)
    m = Llama(c).double()
    idx = torch.randint(0, c["vocab"], (1, 10), generator=g)
    idx2 = idx.clone()
    idx2[0, 6] = (idx[0, 6] + 1) % c["vocab"]
    with torch.no_grad():
        l1, l2 = m.logits(idx), m.logits(idx2)
    check((l1[0, :6] - l2[0, :6]).abs().max().item() == 0.0 and (l1[0, 6:] - l2[0, 6:]).abs().max().item() > 0,
          "causal: changing token 6 changes logits 6.. and none before")

    # 10. safetensors round trip, strict load, no lm_head when tied; the spec's metadata string
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for tied in (False, True):
            c = dict(PRESETS["llama-tiny"], tie_embeddings=tied)
            m = Llama(c)
            path = os.path.join(d, f"w{int(tied)}.safetensors")
            save_safetensors(path, m.state_dict())
            back = load_safetensors(path)
            m2 = Llama(c)
            m2.load_state_dict(back, strict=True)
            meta, dtypes = safetensors_metadata(path)
            same = all(torch.equal(v, m2.state_dict()[k]) for k, v in m.state_dict().items())
            check(same and meta == {"format": "pt"} and set(dtypes.values()) == {"F32"}
                  and ("lm_head.weight" in back) == (not tied),
                  f"safetensors round trip, strict load, {'tied: no lm_head' if tied else 'untied: lm_head'}")
    check(describe(PRESETS["llama-tiny"]) == "arch=llama n_layer=2 n_head=4 n_kv_head=2 d_model=128 ffn_dim=384 "
          "ctx=128 vocab=256 rope_theta=10000 norm_eps=1e-05 tie_embeddings=0",
          "trn.model description = the spec's example")

    # 11. AdamW decays exactly the 2-D tensors
    ns = argparse.Namespace(weight_decay=0.1, lr=1e-3, beta1=0.9, beta2=0.95)
    m = Llama(PRESETS["llama-tiny"])
    opt = make_optimizer(m, ns)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in m.named_parameters() if id(p) in decayed}
    check(opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
          and names == {n for n, s in spec_tensors(PRESETS["llama-tiny"]).items() if len(s) == 2},
          f"AdamW: weight decay on the {len(names)} 2-D tensors, none on the norm weights")

    # 12. the bf16 scheme model trains like fp32 (2e-2), and its weight gradients flow through the transposes
    c = dict(PRESETS["llama-tiny"])
    torch.manual_seed(9)
    m32 = Llama(c)
    m16 = Llama(dict(c, bf16=True))
    m16.load_state_dict(m32.state_dict())
    idx = torch.randint(0, 256, (2, 32), generator=g)
    tgt = torch.randint(0, 256, (2, 32), generator=g)
    l32, l16 = m32(idx, tgt), m16(idx, tgt)
    l32.backward()
    l16.backward()
    gd = max((p16.grad - p32.grad).abs().max().item() / p32.grad.abs().max().item()
             for p16, p32 in zip(m16.parameters(), m32.parameters()))
    check(abs(l16.item() - l32.item()) < 2e-2 * l32.item() and gd < 5e-2,
          f"bf16 scheme: loss within {abs(l16.item() - l32.item()) / l32.item():.1e} of fp32, "
          f"gradients within {gd:.1e}")

    print("PASS" if check.failed == 0 else f"FAIL: {check.failed} check(s)")
    return 0 if check.failed == 0 else 1


# ---------------------------------------------------------------------------------------------


def bench(a, c):
    return gpt2_bench(a, c, Llama)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["compare", "diagnose", "selftest", "bench"])
    p.add_argument("--trn-train", default="trn-train")
    p.add_argument("--trnrun", default="trnrun", help="launcher for --tp or --pp > 1")
    p.add_argument("--tp", type=int, default=1, help="train trn with this many tensor-parallel workers")
    p.add_argument("--pp", type=int, default=1,
                   help="... times this many pipeline stages (1F1B, a micro-batch per sequence)")
    p.add_argument("--workdir", default="/tmp/trn-llama-reference")
    p.add_argument("--model", default="llama-tiny", choices=["llama-tiny", "llama-small"])
    p.add_argument("--n-layer", type=int, default=0, help="override the preset's number of blocks")
    p.add_argument("--n-kv-head", type=int, default=0, help="override the preset's number of KV heads")
    p.add_argument("--tie-embeddings", type=int, default=-1, choices=[-1, 0, 1],
                   help="override the preset's head tying")
    p.add_argument("--shape-from-init", action="store_true",
                   help="write the configuration into the init file's metadata and give trn-train no --arch, "
                        "--model or shape flags (it reads the shape from --init)")
    p.add_argument("--head-dim", type=int, default=0, help="an explicit head_dim (0: d_model / n_head)")
    p.add_argument("--qkv-bias", action="store_true", help="q, k and v projections with biases (Qwen2)")
    p.add_argument("--rope-factor", type=float, default=0, help="llama3 rope scaling's factor (0: none)")
    p.add_argument("--rope-low-freq-factor", type=float, default=1)
    p.add_argument("--rope-high-freq-factor", type=float, default=4)
    p.add_argument("--rope-original-ctx", type=int, default=8192)
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
                   help="compare: bf16 runs trn-train --precision bf16 against trn's bf16 scheme in PyTorch; "
                        "bench: bf16 trains under torch.autocast bf16")
    p.add_argument("--bf16-kernels", default="", choices=["", "auto", "emulated", "onednn"],
                   help="compare --precision bf16: force trn's bf16 kernel path")
    a = p.parse_args()
    if a.mode == "selftest":
        return selftest(a)
    c = config_from(a)
    if a.mode == "bench":
        return bench(a, c)
    torch.set_num_threads(1)
    return diagnose(a, c) if a.mode == "diagnose" else compare(a, c)


if __name__ == "__main__":
    sys.exit(main())
