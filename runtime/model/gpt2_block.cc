// GPT-2's bodies (gpt2.h) over a precision policy, run by the shared slot machine (stage_impl.h).
#include <algorithm>
#include <array>
#include <cstring>

#include "runtime/kernels/ref.h"
#include "runtime/model/gpt2.h"
#include "runtime/model/layers.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace gpt2 {

template <typename T>
struct BlockActs {
  // The inputs of the four matmuls and attention; atty, the attention's output, is also what its
  // backward takes for the softmax's row terms.
  SavedInput<T> ln1, qkv, atty, ln2, fch_gelu;
  // lse: the attention rows' log-sum-exp (B,NH,T), from which backward computes the probabilities
  // again (kernels.h attention_forward).
  std::vector<T> ln1_mean, ln1_rstd, lse, res2, ln2_mean, ln2_rstd, fch, res3;
  // The output gradients of the four matmuls, kept by an input-only backward for the weight pass
  // (zero-bubble schedules): mlp.c_proj, mlp.c_fc, attn.c_proj, attn.c_attn.
  std::vector<T> d_fcproj, d_fc, d_attnproj, d_attn;
};

template <typename T>
struct HeadActs {
  SavedInput<T> lnf;  // the LM head's input
  std::vector<T> lnf_mean, lnf_rstd, probs, losses;
  std::vector<int32_t> targets;
};

// A row-parallel linear layer and the residual after it: out = all-reduce(inp (N,IC) @ w (IC,OC))
// + bias + residual, over this rank's rows r (out and residual hold those; the product of all N
// goes through s.seq under sequence parallelism, whose reduce-scatter replaces the all-reduce).
// With one rank the bias rides the matmul.
template <class P, typename T>
void row_parallel_forward(const P& pol, T* out, typename P::Operand inp, typename P::Operand w, const T* bias,
                          const T* residual, const SeqRows& r, int IC, int OC, BackwardScratch<T>& s,
                          tp::Region& tp) {
  const int N = int(r.N);
  if (tp.size() == 1 && !r.split) {
    pol.matmul_forward(out, inp, w, bias, N, IC, OC);
  } else {
    T* partial = r.split ? s.seq.data() : out;
    pol.matmul_forward(partial, inp, w, static_cast<const T*>(nullptr), N, IC, OC);
    const T* sums = reduce_rows(r, tp, partial, size_t(OC));
    if (sums != out) std::memcpy(out, sums, sizeof(T) * r.local * OC);
    ops::add_bias(out, bias, int(r.local), OC);
  }
  const size_t n = r.local * OC;
  for (size_t i = 0; i < n; ++i) out[i] += residual[i];
}

// A LayerNorm of this rank's rows (in, mean, rstd: those rows) into x (N x C) at their place,
// then all N gathered under sequence parallelism: the matmul input of a column-parallel block.
template <typename T>
void layernorm_rows(T* x, T* mean, T* rstd, const T* in, const T* w, const T* b, const SeqRows& r, int C,
                    tp::Region& tp) {
  kernels::ref::layernorm_forward(x + r.first * C, mean, rstd, in, w, b, int(r.local), C);
  if (r.split) tp.gather(x, r.local * C);
}

// The buffers of a block (A: BlockActs<T>, const or not), each given to fn(vector, n).
// Under sequence parallelism the norms' statistics and the residuals hold this rank's rows only;
// the norms' outputs (matmul inputs) all of them, gathered.
template <class P, class A, class Fn>
void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const SeqRows r(lay, B, Tn);
  const size_t N = r.N, Nl = r.local, C = lay.config().d_model;
  const size_t Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  P::reserve(a.ln1, N * C, fn);
  fn(a.ln1_mean, Nl);
  fn(a.ln1_rstd, Nl);
  P::reserve(a.qkv, N * 3 * Ca, fn);
  fn(a.lse, size_t(B) * NH * Tn);
  P::reserve(a.atty, N * Ca, fn);
  fn(a.res2, Nl * C);
  P::reserve(a.ln2, N * C, fn);
  fn(a.ln2_mean, Nl);
  fn(a.ln2_rstd, Nl);
  fn(a.fch, N * Cm);
  P::reserve(a.fch_gelu, N * Cm, fn);
  fn(a.res3, Nl * C);
}

template <class P, class A, class Fn>
void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const SeqRows r(lay, B, Tn);
  const size_t N = r.N, C = lay.config().d_model;
  P::reserve(a.lnf, N * C, fn);
  fn(a.lnf_mean, r.local);
  fn(a.lnf_rstd, r.local);
  fn(a.probs, N * size_t(lay.local_vocab()));
  fn(a.losses, N);
  fn(a.targets, N);
}


// Each matmul input is computed where the policy says: in place in its SavedInput, or in the
// scratch given here (dtmp for the C- and Ca-wide ones, dbig for qkv and fch_gelu; each free at
// that point), and multiplied as keep() returns it.
template <class P, typename T>
void block_forward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                   BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  const Gpt2Offsets o = gpt2_offsets(lay, layer);
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const SeqRows r(lay, B, Tn);
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  T* x = pol.output(a.ln1, s.dtmp.data());
  layernorm_rows(x, a.ln1_mean.data(), a.ln1_rstd.data(), in, p.f32(o.ln1_w), p.f32(o.ln1_b), r, C, tp);
  const auto ln1 = pol.keep(a.ln1, x, NC);
  // Column-parallel: this rank's heads' q, k and v.
  x = pol.output(a.qkv, s.dbig.data());
  pol.matmul_forward(x, ln1, pol.weight(o.attn_w), p.f32(o.attn_b), N, C, 3 * Ca);
  const auto qkv = pol.keep(a.qkv, x, size_t(N) * 3 * Ca);
  x = pol.output(a.atty, s.dtmp.data());
  pol.attention_forward(x, a.lse.data(), qkv, B, Tn, Ca, NH);
  const auto atty = pol.keep(a.atty, x, size_t(N) * Ca);
  // Row-parallel: partial outputs all-reduced (reduce-scattered under sequence parallelism).
  row_parallel_forward(pol, a.res2.data(), atty, pol.weight(o.attnproj_w), p.f32(o.attnproj_b), in, r, Ca, C, s,
                       tp);
  x = pol.output(a.ln2, s.dtmp.data());
  layernorm_rows(x, a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p.f32(o.ln2_w), p.f32(o.ln2_b), r, C,
                 tp);
  const auto ln2 = pol.keep(a.ln2, x, NC);
  pol.matmul_forward(a.fch.data(), ln2, pol.weight(o.fc_w), p.f32(o.fc_b), N, C, Cm);  // column-parallel
  x = pol.output(a.fch_gelu, s.dbig.data());
  ops::gelu_forward(x, a.fch.data(), size_t(N) * Cm);
  const auto fch_gelu = pol.keep(a.fch_gelu, x, size_t(N) * Cm);
  row_parallel_forward(pol, a.res3.data(), fch_gelu, pol.weight(o.fcproj_w), p.f32(o.fcproj_b), a.res2.data(), r,
                       Cm, C, s, tp);
}

// Selective recomputation (Config::recompute_selective): the matmul inputs that are cheap to
// compute again and as large as what they come from (the two LayerNorms' outputs, from the kept
// input, mean and rstd; the GELU's, from fch) are not kept per block; before a block's backward
// they are computed again exactly as block_forward computed them, into the stage's one shared set.
// Under sequence parallelism the LayerNorms' gathered outputs (gathered_inputs, a subset) are
// never kept per block either: a kept copy of this rank's rows would have to be gathered again
// all the same, so recompute_inputs computes the rows again (a pass over N/tp x C) and gathers.
template <class A>
auto selective_inputs(A& a) {
  return std::array{&a.ln1, &a.ln2, &a.fch_gelu};
}
template <class A>
auto gathered_inputs(A& a) {
  return std::array{&a.ln1, &a.ln2};
}

// The two LayerNorms' outputs, and with mlp the GELU's.
template <class P, typename T>
void recompute_inputs(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                      BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp, bool mlp) {
  const Gpt2Offsets o = gpt2_offsets(lay, layer);
  const SeqRows r(lay, B, Tn);
  const int C = lay.config().d_model, Cm = lay.local_mlp(), N = B * Tn;
  const size_t NC = size_t(N) * C;
  T* x = pol.output(a.ln1, s.dtmp.data());
  layernorm_rows(x, a.ln1_mean.data(), a.ln1_rstd.data(), in, p.f32(o.ln1_w), p.f32(o.ln1_b), r, C, tp);
  pol.keep(a.ln1, x, NC);
  x = pol.output(a.ln2, s.dtmp.data());
  layernorm_rows(x, a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p.f32(o.ln2_w), p.f32(o.ln2_b), r, C,
                 tp);
  pol.keep(a.ln2, x, NC);
  if (!mlp) return;
  x = pol.output(a.fch_gelu, s.dbig.data());
  ops::gelu_forward(x, a.fch.data(), size_t(N) * Cm);
  pol.keep(a.fch_gelu, x, size_t(N) * Cm);
}

// The order of the done() calls is the contract with gradient sync (prefix_done): one body, so
// every policy keeps it. An output gradient is spent (may be rounded in place) when only its
// matmul reads it afterwards; the residual gradient dres is kept.
template <class P, typename T>
void block_backward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                    const GradView<T>& g, const T* in, BlockActs<T>& a, T* dres, BackwardScratch<T>& s, int B,
                    int Tn, tp::Region& tp, const std::function<void(size_t)>& done, BackwardPart part) {
  const Gpt2Offsets o = gpt2_offsets(lay, layer);
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const SeqRows r(lay, B, Tn);
  const int N = B * Tn, Nl = int(r.local);
  const size_t NC = size_t(N) * C;
  T* dtmp = s.dtmp.data();
  T* dbig = s.dbig.data();
  const bool full = part == BackwardPart::kFull;
  // The gradient of a row-parallel block's output: dres, or under sequence parallelism all N
  // rows of it gathered into s.seq, a copy its matmul may round in place.
  auto out_grad = [&](T* spare) {
    if (!r.split) return OutGrad<T>::kept(dres, spare);
    gather_rows(r, tp, dres, s.seq.data(), size_t(C));
    return OutGrad<T>::spent(s.seq.data());
  };
  // Only a full pass finalises tensors: after an input-only one the weights are still to come.
  auto done_if_full = [&](size_t end) {
    if (full) done(end);
  };
  // An input-only pass keeps each matmul's output gradient for backward_weights.
  auto keep = [&](std::vector<T>& to, const T* from, size_t n) {
    if (!full) to.assign(from, from + n);
  };
  // res3 = res2 + fcproj(gelu(fc(ln2(res2))))
  keep(a.d_fcproj, dres, NC);  // (zero-bubble schedules: not under sequence parallelism)
  // dtmp is free until c_fc's input gradient: it may take the rounded dres.
  pol.matmul_backward(dbig, full ? g.at(o.fcproj_w) : nullptr, g.at(o.fcproj_b), out_grad(dtmp),
                      pol.saved(a.fch_gelu), pol.weight(o.fcproj_w), N, Cm, C);
  done_if_full(o.fc_w);
  ops::gelu_backward(dbig, a.fch.data(), dbig, size_t(N) * Cm);
  keep(a.d_fc, dbig, size_t(N) * Cm);
  pol.matmul_backward(dtmp, full ? g.at(o.fc_w) : nullptr, g.at(o.fc_b), OutGrad<T>::spent(dbig),
                      pol.saved(a.ln2), pol.weight(o.fc_w), N, C, Cm);
  // Column-parallel: the input gradient is a sum over the shards (this rank's rows of it under
  // sequence parallelism).
  const T* dln = reduce_rows(r, tp, dtmp, size_t(C));
  done_if_full(o.ln2_w);
  norm_weight_grads(r, tp, s.dnorm, g.at(o.ln2_w), g.at(o.ln2_b), size_t(C), [&](T* dw, T* db) {
    kernels::ref::layernorm_backward(dres, dw, db, dln, a.res2.data(), p.f32(o.ln2_w), a.ln2_mean.data(),
                                     a.ln2_rstd.data(), Nl, C);
  });
  done_if_full(o.attnproj_w);
  // res2 = in + attnproj(attention(attn(ln1(in))))
  keep(a.d_attnproj, dres, NC);
  // dbig is spent (c_fc's gradient) and free until attention's: it may take the rounded dres
  // when it is wide enough.
  pol.matmul_backward(dtmp, full ? g.at(o.attnproj_w) : nullptr, g.at(o.attnproj_b),
                      out_grad(s.dbig.size() >= NC ? dbig : nullptr), pol.saved(a.atty), pol.weight(o.attnproj_w),
                      N, Ca, C);
  done_if_full(o.attn_w);
  pol.attention_backward(dbig, dtmp, pol.saved(a.qkv), pol.saved(a.atty), a.lse.data(), B, Tn, Ca, NH);
  keep(a.d_attn, dbig, size_t(N) * 3 * Ca);
  pol.matmul_backward(dtmp, full ? g.at(o.attn_w) : nullptr, g.at(o.attn_b), OutGrad<T>::spent(dbig),
                      pol.saved(a.ln1), pol.weight(o.attn_w), N, C, 3 * Ca);
  dln = reduce_rows(r, tp, dtmp, size_t(C));
  done_if_full(o.ln1_w);
  norm_weight_grads(r, tp, s.dnorm, g.at(o.ln1_w), g.at(o.ln1_b), size_t(C), [&](T* dw, T* db) {
    kernels::ref::layernorm_backward(dres, dw, db, dln, in, p.f32(o.ln1_w), a.ln1_mean.data(), a.ln1_rstd.data(),
                                     Nl, C);
  });
  done_if_full(o.end);
}

// Weights and biases of the four matmuls, in a full backward's order; the kept gradients are
// read again by nothing else, but const (a policy rounds them into its own scratch).
template <class P, typename T>
void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, const GradView<T>& g,
                            const BlockActs<T>& a, int B, int Tn) {
  const Gpt2Offsets o = gpt2_offsets(lay, layer);
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), N = B * Tn;
  T* none = nullptr;
  const typename P::Operand no_w{};
  pol.matmul_backward(none, g.at(o.fcproj_w), g.at(o.fcproj_b), OutGrad<T>::kept(a.d_fcproj.data()),
                      pol.saved(a.fch_gelu), no_w, N, Cm, C);
  pol.matmul_backward(none, g.at(o.fc_w), g.at(o.fc_b), OutGrad<T>::kept(a.d_fc.data()), pol.saved(a.ln2),
                      no_w, N, C, Cm);
  pol.matmul_backward(none, g.at(o.attnproj_w), g.at(o.attnproj_b), OutGrad<T>::kept(a.d_attnproj.data()),
                      pol.saved(a.atty), no_w, N, Ca, C);
  pol.matmul_backward(none, g.at(o.attn_w), g.at(o.attn_b), OutGrad<T>::kept(a.d_attn.data()),
                      pol.saved(a.ln1), no_w, N, C, 3 * Ca);
}

// ---- Embedding and head ----

// out (N,C) = wte[tok] + wpe[position] for tokens (B,T), a token's position in its sequence
// (Placement::position under context parallelism); wte rows outside this rank's slice add 0.
// Under sequence parallelism only this rank's rows (SeqRows, at their place in out) are computed.
template <typename T>
void embed_forward(const ParamLayout& lay, const WeightView<T>& p, const int32_t* tok, T* out, int B, int Tn,
                   tp::Region& tp) {
  const int C = lay.config().d_model;
  const SeqRows r(lay, B, Tn);
  embed_tokens(lay, p, tok, out, r.N, tp);
  const Placement& place = lay.placement();
  const T* wpe = p.f32(lay.extra[0], size_t(Tn) * place.cp * C);  // every position of a sequence
  for (size_t n = r.first; n < r.first + r.local; ++n) {
    T* o = out + n * C;
    const T* pe = wpe + size_t(place.position(int(n % size_t(Tn)), Tn)) * C;
    for (int i = 0; i < C; ++i) o[i] += pe[i];
  }
}

// dwte (local rows), dwpe += from dout (B,T,C), all N rows (the stage gathers them under sequence
// parallelism).
template <typename T>
void embed_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok, int B,
                    int Tn) {
  const int C = lay.config().d_model;
  embed_tokens_backward(lay, g, dout, tok, size_t(B) * Tn);
  const Placement& place = lay.placement();
  T* dwpe = g.at(lay.extra[0], size_t(Tn) * place.cp * C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) {
      const T* d = dout + (size_t(b) * Tn + t) * C;
      T* pe = dwpe + size_t(place.position(t, Tn)) * C;
      for (int k = 0; k < C; ++k) pe[k] += d[k];
    }
}

// ln_f, then the logits over this rank's rows of the tied wte; returns the sum of the token
// losses against targets (targets null: logits only, left unnormalised in a.probs).
template <class P, typename T>
double head_forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in,
                    const int32_t* targets, HeadActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                    tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int Vl = static_cast<int>(lay.local_vocab());
  T* logits = a.probs.data();
  T* x = pol.output(a.lnf, s.dtmp.data());
  layernorm_rows(x, a.lnf_mean.data(), a.lnf_rstd.data(), in, p.f32(lay.final_norm[0]), p.f32(lay.final_norm[1]),
                 SeqRows(lay, B, Tn), C, tp);
  pol.lmhead_forward(logits, pol.keep(a.lnf, x, size_t(N) * C), pol.weight(lay.head), N, C, Vl);
  if (!targets) return 0.0;
  return vocab_parallel_loss(lay, logits, targets, a.targets.data(), a.losses.data(), N, tp);
}

// dres (B,T,C) = the gradient of in (overwritten) of loss_scale * sum of token losses.
template <class P, typename T>
void head_backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const GradView<T>& g,
                   const T* in, HeadActs<T>& a, T loss_scale, T* dres, BackwardScratch<T>& s, int B, int Tn,
                   tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int Vl = static_cast<int>(lay.local_vocab());
  T* dl = a.probs.data();  // probabilities become dlogits in place
  vocab_parallel_loss_backward(lay, dl, a.targets.data(), loss_scale, N);
  T* dtmp = s.dtmp.data();
  // dlogits are spent after the head's products.
  pol.lmhead_backward(dtmp, g.at(lay.head), OutGrad<T>::spent(dl), pol.saved(a.lnf), pol.weight(lay.head), N,
                      C, Vl);
  // The head is column-parallel over the vocabulary.
  const SeqRows r(lay, B, Tn);
  const T* dln = reduce_rows(r, tp, dtmp, size_t(C));
  std::fill(dres, dres + r.local * C, T(0));
  norm_weight_grads(r, tp, s.dnorm, g.at(lay.final_norm[0]), g.at(lay.final_norm[1]), size_t(C), [&](T* dw, T* db) {
    kernels::ref::layernorm_backward(dres, dw, db, dln, in, p.f32(lay.final_norm[0]), a.lnf_mean.data(),
                                     a.lnf_rstd.data(), int(r.local), C);
  });
}

}  // namespace gpt2

// The bodies as the slot machine calls them (stage_impl.h).
struct Gpt2 {
  template <typename T>
  using BlockActs = gpt2::BlockActs<T>;
  template <typename T>
  using HeadActs = gpt2::HeadActs<T>;
  template <class P, class A, class Fn>
  static void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    gpt2::block_buffers<P>(a, lay, B, Tn, fn);
  }
  template <class P, class A, class Fn>
  static void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    gpt2::head_buffers<P>(a, lay, B, Tn, fn);
  }
  static size_t wide(const ParamLayout& lay) {
    return std::max(size_t(lay.local_mlp()), 3 * size_t(lay.local_attn()));
  }
  static size_t attention_row(const ParamLayout& lay) { return 3 * size_t(lay.local_attn()); }
  template <class S, class Fn>
  static void scratch_buffers(const ParamLayout&, int, int, S&, Fn&&) {}
  template <typename T>
  static void prepare(const ParamLayout&, int, BackwardScratch<T>&) {}
  template <typename T>
  static const T* block_output(const BlockActs<T>& a) {
    return a.res3.data();
  }
  template <typename T>
  static void embed_forward(const ParamLayout& lay, const WeightView<T>& p, const int32_t* tok, T* out, int B,
                            int Tn, tp::Region& tp) {
    gpt2::embed_forward(lay, p, tok, out, B, Tn, tp);
  }
  template <typename T>
  static void embed_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok,
                             int B, int Tn) {
    gpt2::embed_backward(lay, g, dout, tok, B, Tn);
  }
  template <class P, typename T>
  static void block_forward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                            const T* in, BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                            tp::Region& tp) {
    gpt2::block_forward(pol, lay, layer, p, in, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void block_backward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                             const GradView<T>& g, const T* in, BlockActs<T>& a, T* dres,
                             BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                             const std::function<void(size_t)>& done, BackwardPart part) {
    gpt2::block_backward(pol, lay, layer, p, g, in, a, dres, s, B, Tn, tp, done, part);
  }
  template <class A>
  static auto selective_inputs(A& a) {
    return gpt2::selective_inputs(a);
  }
  template <class A>
  static auto gathered_inputs(A& a) {
    return gpt2::gathered_inputs(a);
  }
  template <class P, typename T>
  static void recompute_inputs(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                               const T* in, BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                               bool selective) {
    gpt2::recompute_inputs(pol, lay, layer, p, in, a, s, B, Tn, tp, selective);
  }
  template <class P, typename T>
  static void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, const GradView<T>& g,
                                     const BlockActs<T>& a, BackwardScratch<T>&, int B, int Tn) {
    gpt2::block_backward_weights(pol, lay, layer, g, a, B, Tn);
  }
  template <class P, typename T>
  static double head_forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in,
                             const int32_t* targets, HeadActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                             tp::Region& tp) {
    return gpt2::head_forward(pol, lay, p, in, targets, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void head_backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p,
                            const GradView<T>& g, const T* in, HeadActs<T>& a, T loss_scale, T* dres,
                            BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
    gpt2::head_backward(pol, lay, p, g, in, a, loss_scale, dres, s, B, Tn, tp);
  }
};

StageFactory<float> gpt2_stage_f() { return stage_factory_f<Gpt2>(); }
StageFactory<double> gpt2_stage_d() { return stage_factory_d<Gpt2>(); }

}  // namespace trn::model
