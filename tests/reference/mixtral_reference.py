#!/usr/bin/python3
"""PyTorch reference for trn's mixture-of-experts family (--arch mixtral; system interpreter).

The model is Hugging Face's MixtralForCausalLM written out (the transformers package is not
used): Llama's attention and norms (llama_reference.py) with each block's MLP replaced by a
sparse MoE layer under the same state-dict names, model.layers.{i}.block_sparse_moe.gate.weight
[E, C] and .experts.{e}.w1 (gate) / .w3 (up) [F, C] and .w2 (down) [C, F]. The MoE maths is
trn's contract (runtime/kernels/moe.h):

  router    logits = x W_gate^T, softmax in fp32 over all E experts; the top k by probability
            (by probability x exp(bias) under --moe-balance bias, DeepSeek-V3's bias, so on the
            logits: it moves the choice, not the weight; after each step it moves by
            --moe-bias-rate R x (mean load - load) / mean load);
            weights = the chosen probabilities, renormalised over the k (--moe-norm-topk 1,
            Mixtral) or not (OLMoE).
  capacity  0: dropless. Else each expert takes at most ceil(f * k * T / E) choices per sequence
            of T tokens, first choices before second ones, each in token order; a dropped choice
            contributes nothing (the token keeps its residual).
  experts   SwiGLU: w2(silu(w1 x) * w3 x), each over its own tokens only (index_select, then
            index_add of the weighted outputs: the usual PyTorch form, also the speed anchor).
  aux loss  per layer and sequence: E * sum_e f_e * P_e, f_e the share of the sequence's k * T
            choices (before the capacity) that went to e, P_e its mean probability; averaged over
            the batch's sequences, summed over layers, added to the cross-entropy times coef.

compare: trains trn-train --arch mixtral from this model's initial weights on the batches trn
dumps, and checks per-step cross-entropy to 1e-4 relative, aux_loss likewise, final weights to
1e-4 max-abs, the saved file's names (load_state_dict strict=True). Exits 1 on any mismatch.
selftest: the MoE layer against a dense float64 computation written independently (every expert
on every token, masked), the gradient by torch.autograd.gradcheck, the capacity and aux loss on
hand cases; needs no trn.
bench: tokens/s and peak RSS of training on random tokens (the anchor for bench/moe.sh).
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_reference as llama  # noqa: E402
from gpt2_reference import load_safetensors, lr_at, make_optimizer, save_safetensors  # noqa: E402

PRESETS = {
    "mixtral-tiny": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_dim=96, ctx=128, vocab=256,
                         rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                         n_experts=4, top_k=2, norm_topk=True),
    "moe-small": dict(n_layer=4, n_head=8, n_kv_head=8, d_model=256, ffn_dim=256, ctx=256, vocab=256,
                      rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                      n_experts=16, top_k=4, norm_topk=False),
}


class Expert(nn.Module):
    def __init__(self, C, F_, device=None):
        super().__init__()
        self.w1 = llama.Linear(C, F_, device=device)
        self.w2 = llama.Linear(F_, C, device=device)
        self.w3 = llama.Linear(C, F_, device=device)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def capacity_mask(idx, T, E, factor):
    """(N, k) bool: which choices the per-sequence capacity keeps (first choices first, token order)."""
    N, k = idx.shape
    keep = torch.ones(N, k, dtype=torch.bool)
    if factor <= 0:
        return keep
    cap = math.ceil(factor * k * T / E)
    for s0 in range(0, N, T):
        taken = [0] * E
        for j in range(k):
            for n in range(s0, s0 + T):
                e = int(idx[n, j])
                if taken[e] < cap:
                    taken[e] += 1
                else:
                    keep[n, j] = False
    return keep


class SparseMoe(nn.Module):
    """HF MixtralSparseMoeBlock's names: gate, experts.{e}.w1/w2/w3. forward returns (y, aux (nseq,), loads (E,))."""

    def __init__(self, c, device=None):
        super().__init__()
        C, F_, E = c["d_model"], c["ffn_dim"], c["n_experts"]
        self.E, self.k, self.norm_topk = E, c["top_k"], c["norm_topk"]
        self.capacity = c.get("capacity_factor", 0.0)
        self.gate = llama.Linear(C, E, device=device)
        self.experts = nn.ModuleList([Expert(C, F_, device) for _ in range(E)])
        # DeepSeek-V3's balancing bias: a buffer of the gate (in the state dict, never trained).
        if c.get("balance") == "bias":
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        logits = self.gate(flat)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the router in fp32 at least
        probs = F.softmax(logits, dim=-1)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        score = probs if bias is None else probs * torch.exp(bias)  # the order of logits + bias
        idx = torch.topk(score.detach(), self.k, dim=-1).indices
        w = probs.gather(1, idx)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        keep = capacity_mask(idx, T, self.E, self.capacity)
        self.dropped = int((~keep).sum())
        out = torch.zeros_like(flat)
        loads = torch.zeros(self.E, dtype=torch.int64)
        for e in range(self.E):
            tok, j = torch.nonzero((idx == e) & keep, as_tuple=True)
            loads[e] = tok.numel()
            if tok.numel() == 0:
                continue
            y = self.experts[e](torch.index_select(flat, 0, tok))
            out.index_add_(0, tok, y * w[tok, j].unsqueeze(1).to(y.dtype))
        counts = F.one_hot(idx, self.E).sum(1).view(B, T, self.E).sum(1).to(probs.dtype)  # (B, E)
        f = counts / (self.k * T)
        P = probs.view(B, T, self.E).mean(1)
        aux = self.E * (f * P).sum(-1)
        return out.view(B, T, C), aux, loads


class DecoderLayer(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.self_attn = llama.Attention(c, device)
        self.block_sparse_moe = SparseMoe(c, device)
        self.input_layernorm = llama.RMSNorm(c["d_model"], c["norm_eps"], device)
        self.post_attention_layernorm = llama.RMSNorm(c["d_model"], c["norm_eps"], device)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        y, aux, loads = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + y, aux, loads


class Model(nn.Module):
    def __init__(self, c, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["d_model"], device=device)
        self.layers = nn.ModuleList([DecoderLayer(c, device) for _ in range(c["n_layer"])])
        self.norm = llama.RMSNorm(c["d_model"], c["norm_eps"], device)


class Mixtral(nn.Module):
    """MixtralForCausalLM: .model and lm_head. forward returns (cross-entropy, aux summed over layers, loads)."""

    def __init__(self, c, device=None):
        super().__init__()
        self.c = c
        self.model = Model(c, device)
        self.lm_head = llama.Linear(c["d_model"], c["vocab"], device=device)
        proj_std = 0.02 / math.sqrt(2 * c["n_layer"])
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "w2.weight")):
                    p.normal_(0.0, proj_std)
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.model.embed_tokens(idx)
        cos, sin = llama.rope_tables(T, llama.head_dim(self.c), self.c["rope_theta"], x.dtype)
        aux, loads = 0.0, []
        for layer in self.model.layers:
            x, a, l = layer(x, cos, sin)
            aux = aux + a.mean()
            loads.append(l)
        logits = self.lm_head(self.model.norm(x)).float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return ce, aux, loads


def spec_names(c):
    names = ["model.embed_tokens.weight"]
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"] + [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + "post_attention_layernorm.weight", p + "block_sparse_moe.gate.weight"]
        if c.get("balance") == "bias":
            names.append(p + "block_sparse_moe.gate.e_score_correction_bias")
        for e in range(c["n_experts"]):
            names += [p + f"block_sparse_moe.experts.{e}.w{n}.weight" for n in (1, 2, 3)]
    return names + ["model.norm.weight", "lm_head.weight"]


def train_step(model, opt, x, y, lr, grad_clip, coef):
    for g in opt.param_groups:
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)
    ce, aux, loads = model(x, y)
    (ce + coef * aux).backward()
    # An expert no token reached has a zero gradient, not none: AdamW still decays it and moves
    # it by its moments, as an optimizer over a flat gradient buffer does (trn, Megatron).
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    if model.c.get("balance") == "bias":  # each expert's step: rate x its shortfall from the mean load
        rate = float(torch.tensor(model.c["bias_rate"], dtype=torch.float32))  # trn's rate is a float
        for layer, l in zip(model.model.layers, loads):
            moe = layer.block_sparse_moe
            mean = l.sum().double() / moe.E
            if mean > 0:
                moe.gate.e_score_correction_bias += (rate * (mean - l.double()) / mean).float()
    model.dropped = sum(layer.block_sparse_moe.dropped for layer in model.model.layers)
    return ce.item(), float(aux), norm.item()


# ---------------------------------------------------------------------------------------------
# compare against trn-train


def config_from(a):
    c = dict(PRESETS[a.model])
    for k in ("n_layer", "n_experts", "top_k"):
        if getattr(a, k) > 0:
            c[k] = getattr(a, k)
    c["norm_topk"] = bool(a.moe_norm_topk)
    c["capacity_factor"] = a.capacity_factor
    c["balance"] = a.moe_balance
    c["bias_rate"] = a.moe_bias_rate
    return c


def trn_command(a, init, workdir):
    a.shape_from_init, a.n_kv_head, a.tie_embeddings = False, 0, -1
    cmd, metrics, final, batches = llama.trn_command(a, init, workdir)
    cmd[cmd.index("llama")] = "mixtral"  # llama.trn_command's --arch
    cmd += ["--moe-aux-coef", str(a.moe_aux_coef), "--moe-norm-topk", str(a.moe_norm_topk),
            "--capacity-factor", str(a.capacity_factor)]
    if a.moe_balance != "aux":
        cmd += ["--moe-balance", a.moe_balance, "--moe-bias-rate", str(a.moe_bias_rate)]
    for k in ("n_experts", "top_k"):
        if getattr(a, k) > 0:
            cmd += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    if a.dp > 1 or a.ep > 1:
        cmd += ["--dp", str(a.dp)] + (["--ep", str(a.ep)] if a.ep > 1 else [])
        if "--nproc-per-node" in cmd:
            i = cmd.index("--nproc-per-node")
            cmd[i + 1] = str(a.tp * a.pp * a.dp)
        if "--micro-batches" in cmd:  # a micro-batch per sequence of each data-parallel rank
            i = cmd.index("--micro-batches")
            cmd[i + 1] = str(a.batch_size // a.dp)
        else:
            cmd = [a.trnrun, "--nproc-per-node", str(a.dp), "--"] + cmd
    return cmd, metrics, final, batches


def compare(a, c):
    import subprocess
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(a.seed)
    model = Mixtral(c)
    init = os.path.join(a.workdir, "init.safetensors")
    save_safetensors(init, model.state_dict())
    cmd, metrics, final, batches = trn_command(a, init, a.workdir)
    print("$ " + " ".join(cmd))
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if run.returncode != 0:
        print(run.stdout)
        print(f"FAIL: trn-train exited {run.returncode}")
        return 1
    trn = [json.loads(line) for line in open(metrics)]
    tokens = torch.from_numpy(np.fromfile(batches, dtype="<i4").reshape(a.steps, a.batch_size, a.seq_len + 1)
                              .astype(np.int64))
    opt = make_optimizer(model, a)
    ok, worst_ce, worst_aux, dropped = True, 0.0, 0.0, 0
    for s in range(a.steps):
        ce, aux, norm = train_step(model, opt, tokens[s, :, :-1], tokens[s, :, 1:], lr_at(s, a), a.grad_clip,
                                   a.moe_aux_coef)
        rel = abs(ce - trn[s]["loss"]) / abs(ce)
        rel_aux = abs(aux - trn[s]["aux_loss"]) / abs(aux)
        worst_ce, worst_aux = max(worst_ce, rel), max(worst_aux, rel_aux)
        print(f"step {s + 1:3d}  torch ce {ce:.6f} aux {aux:.6f}  trn ce {trn[s]['loss']:.6f} "
              f"aux {trn[s]['aux_loss']:.6f}  rel {rel:.2e} / {rel_aux:.2e}  grad norm torch {norm:.5f} "
              f"trn {trn[s]['grad_norm']:.5f}")
        ok = ok and rel <= 1e-4 and rel_aux <= 1e-4
        dropped += model.dropped
        if trn[s].get("moe_dropped") != model.dropped:
            print(f"FAIL: step {s + 1}: trn dropped {trn[s].get('moe_dropped')} choices, torch {model.dropped}")
            ok = False
    trained = load_safetensors(final)
    names = [n for n in spec_names(c)]
    missing = sorted(set(names) - set(trained))
    if missing:
        print(f"FAIL: trn's saved file lacks {missing[:5]}")
        return 1
    sd = model.state_dict()
    worst_w, worst_name = max(((sd[n] - trained[n]).abs().max().item(), n) for n in names)
    print(f"cross-entropy: worst relative difference {worst_ce:.2e}; aux loss {worst_aux:.2e} (limit 1e-4)")
    print(f"final weights: worst max-abs difference {worst_w:.2e} in {worst_name} (limit 1e-4)")
    if a.capacity_factor > 0:
        print(f"capacity {a.capacity_factor}: {dropped} choices dropped over {a.steps} steps, the same in both")
        ok = ok and dropped > 0  # a capacity that drops nothing would test nothing
    fresh = Mixtral(c)
    fresh.load_state_dict({n: trained[n] for n in sd}, strict=True)
    ok = ok and worst_w <= 1e-4
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# selftest


def dense_moe(x, gate, w1, w2, w3, k, norm_topk):
    """The MoE layer in float64 numpy, every expert on every token, masked (no grouping)."""
    logits = x @ gate.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    N, E = p.shape
    mask = np.zeros((N, E))
    for n in range(N):
        top = np.argsort(-p[n], kind="stable")[:k]
        mask[n, top] = p[n, top] / (p[n, top].sum() if norm_topk else 1.0)
    out = np.zeros_like(x)
    for e in range(E):
        g = x @ w1[e].T
        y = ((g / (1 + np.exp(-g))) * (x @ w3[e].T)) @ w2[e].T
        out += mask[:, e:e + 1] * y
    return out


def selftest(a):
    checks = llama.Checks()
    torch.manual_seed(0)
    for E, k, norm in ((4, 2, True), (8, 3, False)):
        c = dict(d_model=6, ffn_dim=5, n_experts=E, top_k=k, norm_topk=norm)
        moe = SparseMoe(c).double()
        x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0, 0.7)
        y, aux, _ = moe(x)
        want = dense_moe(x.detach().reshape(-1, 6).numpy(), moe.gate.weight.detach().numpy(),
                         [m.w1.weight.detach().numpy() for m in moe.experts],
                         [m.w2.weight.detach().numpy() for m in moe.experts],
                         [m.w3.weight.detach().numpy() for m in moe.experts], k, norm)
        checks(np.abs(y.detach().reshape(-1, 6).numpy() - want).max() < 1e-12,
               f"top-{k} of {E} (renormalised {norm}) equals the dense computation")
        checks(torch.autograd.gradcheck(lambda x_: (lambda r: r[0].sum() + 0.3 * r[1].sum())(moe(x_)), (x,)),
               f"top-{k} of {E}: gradient of output and aux loss by gradcheck")
    # aux on a hand case: one sequence of 2 tokens both routed to expert 0 of 2.
    c = dict(d_model=2, ffn_dim=2, n_experts=2, top_k=1, norm_topk=True)
    moe = SparseMoe(c).double()
    with torch.no_grad():
        moe.gate.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[[2.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    _, aux, loads = moe(x)
    p0 = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-1.0))]
    checks(abs(aux.item() - 2 * (p0[0] + p0[1]) / 2) < 1e-12 and loads.tolist() == [2, 0], "aux loss hand case")
    idx = torch.tensor([[0, 1], [0, 1], [1, 0], [1, 0]])
    checks(capacity_mask(idx, 4, 2, 0.75).tolist() == [[True, True], [True, False], [True, True], [True, False]],
           "capacity keeps first choices first, in token order")
    m = Mixtral(dict(PRESETS["mixtral-tiny"]))
    checks(sorted(m.state_dict()) == sorted(spec_names(m.c)),
           "state-dict names are HF MixtralForCausalLM's")
    return 1 if checks.failed else 0


def bench(a, c):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Mixtral(c)
    opt = make_optimizer(model, a)
    g = torch.Generator().manual_seed(a.seed)
    data = torch.randint(0, c["vocab"], (a.steps + a.warmup_bench, a.batch_size, a.seq_len + 1), generator=g)
    for s in range(a.steps + a.warmup_bench):
        if s == a.warmup_bench:
            t0 = time.perf_counter()
        train_step(model, opt, data[s, :, :-1], data[s, :, 1:], a.lr, a.grad_clip, a.moe_aux_coef)
    dt = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch {a.model} batch {a.batch_size}x{a.seq_len} threads {a.threads}: "
          f"{a.steps * a.batch_size * a.seq_len / dt:.0f} tok/s, peak RSS {rss_mb:.0f} MB")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["compare", "selftest", "bench"])
    p.add_argument("--trn-train", default="trn-train")
    p.add_argument("--trnrun", default="trnrun")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/trn-mixtral-reference")
    p.add_argument("--model", default="mixtral-tiny", choices=sorted(PRESETS))
    p.add_argument("--n-layer", type=int, default=0)
    p.add_argument("--n-experts", type=int, default=0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--moe-norm-topk", type=int, default=1, choices=[0, 1])
    p.add_argument("--moe-aux-coef", type=float, default=0.01)
    p.add_argument("--capacity-factor", type=float, default=0.0)
    p.add_argument("--moe-balance", default="aux", choices=["aux", "bias"])
    p.add_argument("--moe-bias-rate", type=float, default=0.15)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-schedule", default="cosine", choices=["constant", "cosine"])
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup-bench", type=int, default=2)
    a = p.parse_args()
    if a.mode == "selftest":
        return selftest(a)
    c = config_from(a)
    if a.mode == "bench":
        return bench(a, c)
    torch.set_num_threads(1)
    return compare(a, c)


if __name__ == "__main__":
    sys.exit(main())
