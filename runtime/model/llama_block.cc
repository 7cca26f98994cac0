// Llama's bodies (llama.h) over a precision policy, run by the shared slot machine
// (stage_impl.h).
#include <algorithm>
#include <array>
#include <cstring>

#include "runtime/kernels/moe.h"
#include "runtime/model/layers.h"
#include "runtime/model/llama.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace llama {

template <typename T>
struct BlockActs {
  // The inputs of three matmuls and the attention (q and k after RoPE); down_proj's input,
  // silu(gate) * up, is computed again from gu where backward needs it (a pass over N x mlp
  // values, where keeping it would hold as many).
  // atty, the attention's output, is also what its backward takes for the softmax's row terms.
  SavedInput<T> ln1, qkv, atty, ln2;
  // gu: gate and up before the SwiGLU; lse: the attention rows' log-sum-exp (B,H,T), from which
  // backward computes the probabilities again (kernels.h attention_forward).
  std::vector<T> ln1_rstd, res2, ln2_rstd, gu, res3, lse;
  // The output gradients of the four matmuls, kept by an input-only backward for the weight pass
  // (zero-bubble schedules): down_proj, gate/up, o_proj, q/k/v.
  std::vector<T> d_down, d_gu, d_o, d_qkv;
  // The MoE layer in place of the MLP (Config::moe(), mixtral): the routing, the router's
  // probabilities (N x E), the experts' inputs grouped by expert (xs), their [gate | up] rows
  // (hs) and outputs (ys, partial sums over tp), and this forward's balancing loss summed over
  // its sequences. Sized for every choice kept (dropless: N x top_k rows).
  kernels::moe::Routing<T> route;
  std::vector<T> probs, hs, ys;
  SavedInput<T> xs;
  double aux = 0;
};

template <typename T>
struct HeadActs {
  SavedInput<T> lnf;  // the LM head's input
  std::vector<T> lnf_rstd, probs, losses;
  std::vector<int32_t> targets;
};

// This rank's widths: q, k, v (per token), the attention output, the MLP.
struct Widths {
  int C, hd, H, K, qkv, attn, mlp;
  explicit Widths(const ParamLayout& lay)
      : C(lay.config().d_model),
        hd(lay.config().head_dim()),
        H(lay.local_heads()),
        K(lay.local_kv_heads()),
        qkv((H + 2 * K) * hd),
        attn(lay.local_attn()),
        mlp(lay.local_mlp()) {}
};

// Under sequence parallelism the norms' statistics and the residuals hold this rank's rows only;
// the norms' outputs (matmul inputs) all of them, gathered.
template <class P, class A, class Fn>
void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const Widths w(lay);
  const SeqRows r(lay, B, Tn);
  const size_t N = r.N, Nl = r.local;
  P::reserve(a.ln1, N * w.C, fn);
  fn(a.ln1_rstd, Nl);
  P::reserve(a.qkv, N * w.qkv, fn);
  P::reserve(a.atty, N * w.attn, fn);
  fn(a.lse, size_t(B) * w.H * Tn);
  fn(a.res2, Nl * w.C);
  P::reserve(a.ln2, N * w.C, fn);
  fn(a.ln2_rstd, Nl);
  if (lay.config().moe()) {
    const size_t rows = N * size_t(lay.config().top_k);
    fn(a.probs, N * size_t(lay.config().n_experts));
    P::reserve(a.xs, rows * w.C, fn);
    fn(a.hs, rows * 2 * w.mlp);
    fn(a.ys, rows * w.C);
  } else {
    fn(a.gu, N * 2 * w.mlp);
  }
  fn(a.res3, Nl * w.C);
}

// The MoE layer's scratch, in s.extra (Llama::scratch_buffers sizes it): rows = N x top_k.
template <typename T>
struct MoeScratch {
  T* rows_c;    // rows x C: the grouped inputs in fp32 before a bf16 policy keeps them; dys in backward
  T* act;       // rows x F: silu(gate) * up
  T* dact;      // rows x F
  T* dhs;       // rows x 2F
  T* dxs;       // rows x C
  T* logits;    // N x E: the router's logits; their gradient in backward
  T* dweight;   // N x k
  T* dx_router; // N x C
  static size_t size(const ParamLayout& lay, size_t N) {
    const Config& c = lay.config();
    const size_t rows = N * size_t(c.top_k), C = size_t(c.d_model), F = size_t(lay.local_mlp());
    return rows * (2 * C + 4 * F) + N * (size_t(c.n_experts) + size_t(c.top_k) + C);
  }
  MoeScratch(BackwardScratch<T>& s, const ParamLayout& lay, size_t N) {
    const Config& c = lay.config();
    const size_t rows = N * size_t(c.top_k), C = size_t(c.d_model), F = size_t(lay.local_mlp());
    T* at = s.extra.data();
    auto take = [&](size_t n) {
      T* p = at;
      at += n;
      return p;
    };
    rows_c = take(rows * C);
    act = take(rows * F);
    dact = take(rows * F);
    dhs = take(rows * 2 * F);
    dxs = take(rows * C);
    logits = take(N * size_t(c.n_experts));
    dweight = take(N * size_t(c.top_k));
    dx_router = take(N * C);
  }
};

// Expert e's tensors sit at a fixed stride from the first's (llama_spec.cc add_experts: w2, w1, w3).
inline size_t expert_stride(const ParamLayout& lay) {
  return 3 * size_t(lay.config().d_model) * size_t(lay.local_mlp());
}

// The MoE layer in place of the MLP: res3 = res2 + the tp sum of combine(experts(route(ln2))).
// x: ln2's values (all N rows; computed where the policy put them), ln2: the operand the policy
// kept. The router runs on every tp rank alike (replicated weight, the same gathered rows), so
// every tp rank routes the same; each expert is split by tp like a dense MLP, so its outputs are
// partial sums and the combine, linear in them, is summed once (reduce_rows) like a row-parallel
// output.
template <class P, typename T>
void moe_forward(const P& pol, const ParamLayout& lay, const LlamaOffsets& o, const WeightView<T>& p, const T* x,
                 typename P::Operand ln2,
                 BlockActs<T>& a, BackwardScratch<T>& s, const SeqRows& r, int Tn, tp::Region& tp) {
  namespace moe = kernels::moe;
  const Config& c = lay.config();
  const Widths w(lay);
  const int N = int(r.N), E = c.n_experts, F = w.mlp, C = w.C;
  const MoeScratch<T> m(s, lay, r.N);
  pol.linear_forward(m.logits, ln2, pol.weight(o.router), N, C, E);
  moe::softmax_rows(a.probs.data(), m.logits, N, E);
  const T* bias = c.moe_bias ? p.f32(o.moe_bias, size_t(E)) : nullptr;
  moe::route(a.route, a.probs.data(), bias, N, {E, c.top_k, c.moe_norm_topk, c.capacity_factor, Tn});
  const int G = a.route.rows();
  T* xs = pol.output(a.xs, m.rows_c);
  moe::gather(xs, x, a.route, C);
  const auto xs_op = pol.keep(a.xs, xs, size_t(G) * C);
  const size_t stride = expert_stride(lay);
  for (int e = 0; e < E; ++e) {
    const int from = a.route.offset[size_t(e)], n = a.route.offset[size_t(e) + 1] - from;
    if (n > 0)
      pol.linear_forward(a.hs.data() + size_t(from) * 2 * F, xs_op + size_t(from) * C, pol.weight(o.gate + e * stride),
                         n, C, 2 * F);
  }
  ops::swiglu_forward(m.act, a.hs.data(), G, F);
  SavedInput<T> none;  // nothing kept: the policy rounds in place where it rounds
  const auto act = pol.keep(none, m.act, size_t(G) * F);
  for (int e = 0; e < E; ++e) {
    const int from = a.route.offset[size_t(e)], n = a.route.offset[size_t(e) + 1] - from;
    if (n > 0)
      pol.linear_forward(a.ys.data() + size_t(from) * C, act + size_t(from) * F, pol.weight(o.down + e * stride), n, F,
                         C);
  }
  T* partial = r.split ? s.seq.data() : a.res3.data();
  moe::combine(partial, a.ys.data(), a.route, C);
  const T* sums = reduce_rows(r, tp, partial, size_t(C));
  for (size_t i = 0; i < r.local * C; ++i) a.res3[i] = sums[i] + a.res2[i];
  std::vector<T> per_sequence(size_t(N / Tn));
  a.aux = double(moe::aux_forward(per_sequence.data(), a.probs.data(), a.route, Tn));
}

// The MoE layer's backward from dout (the gradient of its output, all N rows): the experts' and
// the router's weight gradients, and dx (N x C, overwritten), this tp rank's part of the
// gradient of the layer's input (the router's part counted on tp rank 0 only, so that the tp sum
// holds it once). The combine weights' gradients are dot products with partial outputs, so they
// are summed over tp first. done(o.router) once the experts' gradients are final.
template <class P, typename T>
void moe_backward(const P& pol, const ParamLayout& lay, const LlamaOffsets& o, const GradView<T>& g, const T* dout,
                  BlockActs<T>& a, BackwardScratch<T>& s, const SeqRows& r, int Tn, tp::Region& tp, T* dx,
                  const std::function<void(size_t)>& done) {
  namespace moe = kernels::moe;
  const Config& c = lay.config();
  const Widths w(lay);
  const int N = int(r.N), E = c.n_experts, F = w.mlp, C = w.C, k = c.top_k;
  const MoeScratch<T> m(s, lay, r.N);
  const int G = a.route.rows();
  T* dys = m.rows_c;
  moe::combine_backward(dys, m.dweight, dout, a.ys.data(), a.route, C);
  if (tp.size() > 1) tp.sum(m.dweight, size_t(N) * k);
  ops::swiglu_forward(m.act, a.hs.data(), G, F);
  SavedInput<T> none;
  const auto act = pol.keep(none, m.act, size_t(G) * F);
  const size_t stride = expert_stride(lay);
  for (int e = 0; e < E; ++e) {
    const int from = a.route.offset[size_t(e)], n = a.route.offset[size_t(e) + 1] - from;
    if (n > 0)
      pol.linear_backward(m.dact + size_t(from) * F, g.at(o.down + e * stride), OutGrad<T>::spent(dys + size_t(from) * C),
                          act + size_t(from) * F, pol.weight(o.down + e * stride), n, F, C);
  }
  ops::swiglu_backward(m.dhs, m.dact, a.hs.data(), G, F);
  const auto xs = pol.saved(a.xs);
  for (int e = 0; e < E; ++e) {
    const int from = a.route.offset[size_t(e)], n = a.route.offset[size_t(e) + 1] - from;
    if (n > 0)
      pol.linear_backward(m.dxs + size_t(from) * C, g.at(o.gate + e * stride),
                          OutGrad<T>::spent(m.dhs + size_t(from) * 2 * F), xs + size_t(from) * C,
                          pol.weight(o.gate + e * stride), n, C, 2 * F);
  }
  done(o.router);
  std::fill(dx, dx + size_t(N) * C, T(0));
  moe::scatter_add(dx, m.dxs, a.route, C);
  moe::router_backward(m.logits, m.dweight, a.probs.data(), a.route, c.moe_norm_topk, Tn, s.aux_scale);
  pol.linear_backward(m.dx_router, g.at(o.router), OutGrad<T>::spent(m.logits), pol.saved(a.ln2),
                      pol.weight(o.router), N, C, E);
  if (tp.rank() == 0)
    for (size_t i = 0; i < size_t(N) * C; ++i) dx[i] += m.dx_router[i];
}

template <class P, class A, class Fn>
void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const SeqRows r(lay, B, Tn);
  const size_t N = r.N, C = lay.config().d_model;
  P::reserve(a.lnf, N * C, fn);
  fn(a.lnf_rstd, r.local);
  fn(a.probs, N * size_t(lay.local_vocab()));
  fn(a.losses, N);
  fn(a.targets, N);
}

// down_proj's input from gu, in s.extra (free in forward, and in backward until gate and up's
// gradient), as the policy multiplies it.
template <class P, typename T>
typename P::Operand swiglu_input(const P& pol, const BlockActs<T>& a, BackwardScratch<T>& s, const Widths& w, int N) {
  T* x = s.extra.data();
  ops::swiglu_forward(x, a.gu.data(), N, w.mlp);
  SavedInput<T> none;  // nothing kept: the policy rounds in place where it rounds
  return pol.keep(none, x, size_t(N) * w.mlp);
}

// RoPE's cos and sin, (Tn, hd/2) each, one after the other in s.tables.
template <typename T>
const T* rope_cos(const BackwardScratch<T>& s) {
  return s.tables.data();
}
template <typename T>
const T* rope_sin(const BackwardScratch<T>& s, int Tn, int hd) {
  return s.tables.data() + size_t(Tn) * (hd / 2);
}

// A row-parallel linear layer: out = all-reduce(x (N,IC) w (OC,IC)^T) + residual, over this
// rank's rows r (out and residual hold those; the product of all N goes through s.seq under
// sequence parallelism, whose reduce-scatter replaces the all-reduce).
template <class P, typename T>
void row_parallel(const P& pol, T* out, typename P::Operand x, typename P::Operand w, const T* residual,
                  const SeqRows& r, int IC, int OC, BackwardScratch<T>& s, tp::Region& tp) {
  T* partial = r.split ? s.seq.data() : out;
  pol.linear_forward(partial, x, w, int(r.N), IC, OC);
  const T* sums = reduce_rows(r, tp, partial, size_t(OC));
  const size_t n = r.local * OC;
  for (size_t i = 0; i < n; ++i) out[i] = sums[i] + residual[i];
}

// An RMSNorm of this rank's rows (in, rstd: those rows) into x (N x C) at their place, then all N
// gathered under sequence parallelism: the matmul input of a column-parallel block.
template <typename T>
void rmsnorm_rows(T* x, T* rstd, const T* in, const T* w, const SeqRows& r, int C, float eps, tp::Region& tp) {
  ops::rmsnorm_forward(x + r.first * C, rstd, in, w, int(r.local), C, eps);
  if (r.split) tp.gather(x, r.local * C);
}

// Each matmul input is computed where the policy says (its SavedInput, or scratch: dtmp for the
// C-wide ones and the attention output, dbig for q/k/v and the SwiGLU output) and multiplied as
// keep() returns it.
template <class P, typename T>
void block_forward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                   BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  const LlamaOffsets o = llama_offsets(lay, layer);
  const Widths w(lay);
  const int N = B * Tn;
  const size_t NC = size_t(N) * w.C;
  const float eps = float(lay.config().norm_eps);
  const SeqRows r(lay, B, Tn);
  T* x = pol.output(a.ln1, s.dtmp.data());
  rmsnorm_rows(x, a.ln1_rstd.data(), in, p.f32(o.input_norm), r, w.C, eps, tp);
  const auto ln1 = pol.keep(a.ln1, x, NC);
  // Column-parallel: this rank's q, k and v heads in one product (their weights are adjacent).
  x = pol.output(a.qkv, s.dbig.data());
  pol.linear_forward(x, ln1, pol.weight(o.q), N, w.C, w.qkv);
  if (lay.config().qkv_bias) ops::add_bias(x, p.f32(o.qkv_bias, size_t(w.qkv)), N, w.qkv);
  ops::rope_forward(x, B, Tn, w.qkv, w.H + w.K, w.hd, rope_cos(s), rope_sin(s, Tn, w.hd));
  const auto qkv = pol.keep(a.qkv, x, size_t(N) * w.qkv);
  x = pol.output(a.atty, s.dtmp.data());
  pol.gqa_attention_forward(x, a.lse.data(), qkv, B, Tn, w.H, w.K, w.hd);
  const auto atty = pol.keep(a.atty, x, size_t(N) * w.attn);
  row_parallel(pol, a.res2.data(), atty, pol.weight(o.o), in, r, w.attn, w.C, s, tp);
  x = pol.output(a.ln2, s.dtmp.data());
  rmsnorm_rows(x, a.ln2_rstd.data(), a.res2.data(), p.f32(o.post_norm), r, w.C, eps, tp);
  const auto ln2 = pol.keep(a.ln2, x, NC);
  if (lay.config().moe()) {
    moe_forward(pol, lay, o, p, x, ln2, a, s, r, Tn, tp);
    return;
  }
  pol.linear_forward(a.gu.data(), ln2, pol.weight(o.gate), N, w.C, 2 * w.mlp);  // gate and up, column-parallel
  row_parallel(pol, a.res3.data(), swiglu_input(pol, a, s, w, N), pol.weight(o.down), a.res2.data(), r, w.mlp, w.C,
               s, tp);
}

// Selective recomputation (Config::recompute_selective): the two RMSNorms' outputs, matmul
// inputs as large as the residual they come from, are not kept per block; before a block's
// backward they are computed again from the kept input and res2 exactly as block_forward computed
// them, into the stage's one shared set (down_proj's input is computed again in every mode).
// Under sequence parallelism they are the gathered inputs, which no block keeps in any mode (a
// kept copy of this rank's rows would have to be gathered again all the same).
template <class A>
auto selective_inputs(A& a) {
  return std::array{&a.ln1, &a.ln2};
}
template <class A>
auto gathered_inputs(A& a) {
  return std::array{&a.ln1, &a.ln2};
}

template <class P, typename T>
void recompute_inputs(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                      BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  const LlamaOffsets o = llama_offsets(lay, layer);
  const Widths w(lay);
  const SeqRows r(lay, B, Tn);
  const size_t NC = r.N * w.C;
  const float eps = float(lay.config().norm_eps);
  T* x = pol.output(a.ln1, s.dtmp.data());
  rmsnorm_rows(x, a.ln1_rstd.data(), in, p.f32(o.input_norm), r, w.C, eps, tp);
  pol.keep(a.ln1, x, NC);
  x = pol.output(a.ln2, s.dtmp.data());
  rmsnorm_rows(x, a.ln2_rstd.data(), a.res2.data(), p.f32(o.post_norm), r, w.C, eps, tp);
  pol.keep(a.ln2, x, NC);
}

// The order of the done() calls is the contract with gradient sync (prefix_done), as in every
// family's body. An output gradient is spent (may be rounded in place) when only its matmul
// reads it afterwards; the residual gradient dres is kept.
template <class P, typename T>
void block_backward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                    const GradView<T>& g, const T* in, BlockActs<T>& a, T* dres, BackwardScratch<T>& s, int B,
                    int Tn, tp::Region& tp, const std::function<void(size_t)>& done, BackwardPart part) {
  const LlamaOffsets o = llama_offsets(lay, layer);
  const Widths w(lay);
  const SeqRows r(lay, B, Tn);
  const int N = B * Tn, Nl = int(r.local);
  const size_t NC = size_t(N) * w.C;
  T* dtmp = s.dtmp.data();
  T* dbig = s.dbig.data();
  T* dgu = s.extra.data();
  const bool full = part == BackwardPart::kFull;
  // The gradient of a row-parallel block's output: dres, or under sequence parallelism all N
  // rows of it gathered into s.seq, a copy its matmul may round in place.
  auto out_grad = [&](T* spare) {
    if (!r.split) return OutGrad<T>::kept(dres, spare);
    gather_rows(r, tp, dres, s.seq.data(), size_t(w.C));
    return OutGrad<T>::spent(s.seq.data());
  };
  auto done_if_full = [&](size_t end) {
    if (full) done(end);
  };
  auto keep = [&](std::vector<T>& to, const T* from, size_t n) {
    if (!full) to.assign(from, from + n);
  };
  if (lay.config().moe()) {
    // res3 = res2 + moe(ln2(res2)); parallel::check refuses split backwards (zero-bubble) with MoE.
    TRN_CHECK(full);
    const T* dout = r.split ? gather_rows(r, tp, dres, s.seq.data(), size_t(w.C)) : dres;
    moe_backward(pol, lay, o, g, dout, a, s, r, Tn, tp, dtmp, done);
  } else {
    // res3 = res2 + down(swiglu(gate_up(ln2(res2))))
    keep(a.d_down, dres, NC);
    pol.linear_backward(dbig, full ? g.at(o.down) : nullptr, out_grad(dtmp), swiglu_input(pol, a, s, w, N),
                        pol.weight(o.down), N, w.mlp, w.C);
    done_if_full(o.gate);
    ops::swiglu_backward(dgu, dbig, a.gu.data(), N, w.mlp);
    keep(a.d_gu, dgu, size_t(N) * 2 * w.mlp);
    pol.linear_backward(dtmp, full ? g.at(o.gate) : nullptr, OutGrad<T>::spent(dgu), pol.saved(a.ln2),
                        pol.weight(o.gate), N, w.C, 2 * w.mlp);
  }
  // Column-parallel: the input gradient is a sum over the shards (this rank's rows of it under
  // sequence parallelism).
  const T* dln = reduce_rows(r, tp, dtmp, size_t(w.C));
  done_if_full(o.post_norm);
  norm_weight_grads(r, tp, s.dnorm, g.at(o.post_norm), static_cast<T*>(nullptr), size_t(w.C), [&](T* dw, T*) {
    ops::rmsnorm_backward(dres, dw, dln, a.res2.data(), p.f32(o.post_norm), a.ln2_rstd.data(), Nl, w.C);
  });
  done_if_full(o.o);
  // res2 = in + o(attention(rope(qkv(ln1(in)))))
  keep(a.d_o, dres, NC);
  pol.linear_backward(dtmp, full ? g.at(o.o) : nullptr, out_grad(s.dbig.size() >= NC ? dbig : nullptr),
                      pol.saved(a.atty), pol.weight(o.o), N, w.attn, w.C);
  done_if_full(o.q);
  pol.gqa_attention_backward(dbig, dtmp, pol.saved(a.qkv), pol.saved(a.atty), a.lse.data(), B, Tn, w.H, w.K, w.hd);
  ops::rope_backward(dbig, B, Tn, w.qkv, w.H + w.K, w.hd, rope_cos(s), rope_sin(s, Tn, w.hd));
  keep(a.d_qkv, dbig, size_t(N) * w.qkv);
  // The q, k, v biases' gradient: the column sums of their output gradient (in this pass, before
  // the product may round it; a zero-bubble weight pass adds none).
  if (lay.config().qkv_bias) {
    T* db = g.at(o.qkv_bias, size_t(w.qkv));
    for (int n = 0; n < N; ++n) {
      const T* d = dbig + size_t(n) * w.qkv;
      for (int j = 0; j < w.qkv; ++j) db[j] += d[j];
    }
  }
  pol.linear_backward(dtmp, full ? g.at(o.q) : nullptr, OutGrad<T>::spent(dbig), pol.saved(a.ln1),
                      pol.weight(o.q), N, w.C, w.qkv);
  dln = reduce_rows(r, tp, dtmp, size_t(w.C));
  done_if_full(o.input_norm);
  norm_weight_grads(r, tp, s.dnorm, g.at(o.input_norm), static_cast<T*>(nullptr), size_t(w.C), [&](T* dw, T*) {
    ops::rmsnorm_backward(dres, dw, dln, in, p.f32(o.input_norm), a.ln1_rstd.data(), Nl, w.C);
  });
  done_if_full(o.end);
}

// The four matmuls' weight gradients, in a full backward's order.
template <class P, typename T>
void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, const GradView<T>& g,
                            const BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn) {
  const LlamaOffsets o = llama_offsets(lay, layer);
  const Widths w(lay);
  const int N = B * Tn;
  T* none = nullptr;
  const typename P::Operand no_w{};
  pol.linear_backward(none, g.at(o.down), OutGrad<T>::kept(a.d_down.data()), swiglu_input(pol, a, s, w, N),
                      no_w, N, w.mlp, w.C);
  pol.linear_backward(none, g.at(o.gate), OutGrad<T>::kept(a.d_gu.data()), pol.saved(a.ln2), no_w, N, w.C,
                      2 * w.mlp);
  pol.linear_backward(none, g.at(o.o), OutGrad<T>::kept(a.d_o.data()), pol.saved(a.atty), no_w, N, w.attn,
                      w.C);
  pol.linear_backward(none, g.at(o.q), OutGrad<T>::kept(a.d_qkv.data()), pol.saved(a.ln1), no_w, N, w.C,
                      w.qkv);
}

template <class P, typename T>
double head_forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in,
                    const int32_t* targets, HeadActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                    tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int Vl = static_cast<int>(lay.local_vocab());
  T* logits = a.probs.data();
  T* x = pol.output(a.lnf, s.dtmp.data());
  rmsnorm_rows(x, a.lnf_rstd.data(), in, p.f32(lay.final_norm[0]), SeqRows(lay, B, Tn), C,
               float(lay.config().norm_eps), tp);
  pol.lmhead_forward(logits, pol.keep(a.lnf, x, size_t(N) * C), pol.weight(lay.head), N, C, Vl);
  if (!targets) return 0.0;
  return vocab_parallel_loss(lay, logits, targets, a.targets.data(), a.losses.data(), N, tp);
}

template <class P, typename T>
void head_backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const GradView<T>& g,
                   const T* in, HeadActs<T>& a, T loss_scale, T* dres, BackwardScratch<T>& s, int B, int Tn,
                   tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int Vl = static_cast<int>(lay.local_vocab());
  T* dl = a.probs.data();
  vocab_parallel_loss_backward(lay, dl, a.targets.data(), loss_scale, N);
  T* dtmp = s.dtmp.data();
  pol.lmhead_backward(dtmp, g.at(lay.head), OutGrad<T>::spent(dl), pol.saved(a.lnf), pol.weight(lay.head), N,
                      C, Vl);
  // The head is column-parallel over the vocabulary.
  const SeqRows r(lay, B, Tn);
  const T* dln = reduce_rows(r, tp, dtmp, size_t(C));
  std::fill(dres, dres + r.local * C, T(0));
  norm_weight_grads(r, tp, s.dnorm, g.at(lay.final_norm[0]), static_cast<T*>(nullptr), size_t(C), [&](T* dw, T*) {
    ops::rmsnorm_backward(dres, dw, dln, in, p.f32(lay.final_norm[0]), a.lnf_rstd.data(), int(r.local), C);
  });
}

}  // namespace llama

// The bodies as the slot machine calls them (stage_impl.h).
struct Llama {
  template <typename T>
  using BlockActs = llama::BlockActs<T>;
  template <typename T>
  using HeadActs = llama::HeadActs<T>;
  template <class P, class A, class Fn>
  static void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    llama::block_buffers<P>(a, lay, B, Tn, fn);
  }
  template <class P, class A, class Fn>
  static void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    llama::head_buffers<P>(a, lay, B, Tn, fn);
  }
  static size_t wide(const ParamLayout& lay) {
    const llama::Widths w(lay);
    return size_t(std::max(w.qkv, 2 * w.mlp));  // 2 mlp: the bf16 scratch rounds gate and up's gradient
  }
  // q, k, v and the output: Bf16Compute's backward widens both for one sequence.
  static size_t attention_row(const ParamLayout& lay) {
    const llama::Widths w(lay);
    return size_t(w.qkv) + size_t(w.attn);
  }
  // The gradient of gate and up (N x 2 ffn / tp), and RoPE's tables.
  template <class S, class Fn>
  static void scratch_buffers(const ParamLayout& lay, int B, int Tn, S& s, Fn&& fn) {
    const llama::Widths w(lay);
    const size_t N = size_t(B) * Tn;
    fn(s.extra, lay.config().moe() ? llama::MoeScratch<typename std::remove_reference_t<decltype(s.extra)>::value_type>::size(lay, N)
                                   : N * 2 * w.mlp);
    fn(s.tables, size_t(Tn) * lay.config().head_dim());
  }
  // The tables' row t is the stage's token t, at its position in the sequence: under context
  // parallelism the whole sequence's table is computed and the rank's positions picked from it.
  template <typename T>
  static void prepare(const ParamLayout& lay, int Tn, BackwardScratch<T>& s) {
    const int hd = lay.config().head_dim(), half = hd / 2;
    const Placement& place = lay.placement();
    if (place.cp == 1) {
      ops::rope_table(s.tables.data(), s.tables.data() + size_t(Tn) * half, Tn, hd, lay.config().rope_theta,
                      rope_scaling(lay.config()));
      return;
    }
    const int whole_len = Tn * place.cp;
    std::vector<T> whole(size_t(whole_len) * hd);
    ops::rope_table(whole.data(), whole.data() + size_t(whole_len) * half, whole_len, hd, lay.config().rope_theta,
                    rope_scaling(lay.config()));
    for (int t = 0; t < Tn; ++t) {
      const size_t at = size_t(place.position(t, Tn)) * half;
      std::copy_n(whole.data() + at, half, s.tables.data() + size_t(t) * half);
      std::copy_n(whole.data() + size_t(whole_len) * half + at, half, s.tables.data() + size_t(Tn + t) * half);
    }
  }
  template <typename T>
  static const T* block_output(const BlockActs<T>& a) {
    return a.res3.data();
  }
  // An MoE block's last forward: its balancing loss (summed over its sequences) into *aux, and
  // each expert's kept choices and the dropped ones into loads (n_experts + 1).
  template <typename T>
  static void moe_note(const BlockActs<T>& a, double* aux, double* loads) {
    *aux += a.aux;
    for (int e = 0; e < a.route.E; ++e) loads[e] += double(a.route.load(e));
    loads[a.route.E] += double(a.route.dropped);
  }
  template <typename T>
  static void embed_forward(const ParamLayout& lay, const WeightView<T>& p, const int32_t* tok, T* out, int B,
                            int Tn, tp::Region& tp) {
    embed_tokens(lay, p, tok, out, size_t(B) * Tn, tp);
  }
  template <typename T>
  static void embed_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok,
                             int B, int Tn) {
    embed_tokens_backward(lay, g, dout, tok, size_t(B) * Tn);
  }
  template <class P, typename T>
  static void block_forward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                            const T* in, BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                            tp::Region& tp) {
    llama::block_forward(pol, lay, layer, p, in, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void block_backward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                             const GradView<T>& g, const T* in, BlockActs<T>& a, T* dres,
                             BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                             const std::function<void(size_t)>& done, BackwardPart part) {
    llama::block_backward(pol, lay, layer, p, g, in, a, dres, s, B, Tn, tp, done, part);
  }
  template <class A>
  static auto selective_inputs(A& a) {
    return llama::selective_inputs(a);
  }
  template <class A>
  static auto gathered_inputs(A& a) {
    return llama::gathered_inputs(a);
  }
  // (Llama's selective set is its gathered one: selective adds nothing to recompute.)
  template <class P, typename T>
  static void recompute_inputs(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                               const T* in, BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                               bool) {
    llama::recompute_inputs(pol, lay, layer, p, in, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, const GradView<T>& g,
                                     const BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn) {
    llama::block_backward_weights(pol, lay, layer, g, a, s, B, Tn);
  }
  template <class P, typename T>
  static double head_forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in,
                             const int32_t* targets, HeadActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                             tp::Region& tp) {
    return llama::head_forward(pol, lay, p, in, targets, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void head_backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p,
                            const GradView<T>& g, const T* in, HeadActs<T>& a, T loss_scale, T* dres,
                            BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
    llama::head_backward(pol, lay, p, g, in, a, loss_scale, dres, s, B, Tn, tp);
  }
};

StageFactory<float> llama_stage_f() { return stage_factory_f<Llama>(); }
StageFactory<double> llama_stage_d() { return stage_factory_d<Llama>(); }

}  // namespace trn::model
