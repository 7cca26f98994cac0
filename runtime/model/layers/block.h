// A family as a composition of layers (layers/README.md): the pre-norm transformer block
//
//   res2 = in + attention(norm1(in))      res3 = res2 + mlp(norm2(res2))
//
// with an embedding in front and a head behind, run by the shared slot machine (stage_impl.h).
// ComposedBody<L> implements stage_impl.h's contract F for a family whose layers L gives:
//
//   using Mlp = GeluMlp | SwigluMlp | ...        (the MLP layer type, layers/mlp.h)
//   static BlockLayers<Mlp> block(const ParamLayout&, int layer)
//                     the block's layers with their offsets (layer -1: widths only, no offsets;
//                     the blocks of a model are alike)
//   static BlockLayers<Mlp> shape(const Config&, int tp)   the widths at tensor-parallel size tp
//   static Embedding embedding(const ParamLayout&)   (on a layout that holds the embedding)
//   static Head head(const ParamLayout&)             (on a layout that holds the head)
//
// So a family's block file is its layers' names and hyperparameters; the bodies below are every
// family's. The order of the done() calls is the contract with gradient sync (prefix_done): a
// block's tensors are laid out in the order backward finishes them (mlp output, mlp input, norm2,
// attention output, q/k/v, norm1; the family's spec), and backward calls done(next tensor) as
// each layer's tensors become final.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/model/family.h"
#include "runtime/model/layers.h"
#include "runtime/model/layers/attention.h"
#include "runtime/model/layers/embedding.h"
#include "runtime/model/layers/mlp.h"
#include "runtime/model/layers/norm.h"
#include "runtime/model/stage.h"

namespace trn::model {

// The bytes a layer's buffers would hold: visit(fn) calls the layer's buffers(..., fn) (on
// empty Acts: nothing is allocated), e.g.
//   buffer_bytes([&](auto fn) { attn.buffers<P>(acts, N, B, Tn, fn); })
template <class Visit>
size_t buffer_bytes(Visit&& visit) {
  size_t n = 0;
  visit([&](const auto& v, size_t k) { n += k * sizeof(v[0]); });
  return n;
}

template <class Mlp>
struct BlockLayers {
  Norm norm1;
  Attention attn;
  Norm norm2;
  Mlp mlp;
  size_t end = 0;  // where the block's tensors end in the buffer

  size_t params() const { return norm1.params() + attn.params() + norm2.params() + mlp.params(); }
  // The usual count: the matmuls' 6 x parameters and attention's products (norms left out).
  double flops_per_token(int seq_len) const { return attn.flops_per_token(seq_len) + mlp.flops_per_token(); }
};

template <class L>
struct ComposedBody {
  using Mlp = typename L::Mlp;

  // What the planner counts of a block (family.h), at tp 1.
  static BlockCounts counts(const Config& c) {
    const BlockLayers<Mlp> b = L::shape(c, 1);
    return {b.norm1.params(), double(b.mlp.weights()), Mlp::kActivationOps};
  }

  template <typename T>
  struct BlockActs {
    // ln1, ln2: the norms' outputs, the inputs of the column-parallel layers after them (under
    // sequence parallelism all N rows, gathered); n1, n2 their statistics and res2, res3 the
    // residual stream (this rank's rows).
    SavedInput<T> ln1;
    typename Norm::template Acts<T> n1;
    typename Attention::template Acts<T> attn;
    std::vector<T> res2;
    SavedInput<T> ln2;
    typename Norm::template Acts<T> n2;
    typename Mlp::template Acts<T> mlp;
    std::vector<T> res3;
  };
  template <typename T>
  using HeadActs = typename Head::template Acts<T>;

  template <class P, class A, class Fn>
  static void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    const BlockLayers<Mlp> b = L::block(lay, -1);
    const SeqRows r(lay, B, Tn);
    const size_t N = r.N, Nl = r.local, C = lay.config().d_model;
    P::reserve(a.ln1, N * C, fn);
    b.norm1.buffers(a.n1, Nl, fn);
    b.attn.template buffers<P>(a.attn, N, B, Tn, fn);
    fn(a.res2, Nl * C);
    P::reserve(a.ln2, N * C, fn);
    b.norm2.buffers(a.n2, Nl, fn);
    b.mlp.template buffers<P>(a.mlp, N, B, fn);
    fn(a.res3, Nl * C);
  }
  // One block's activation bytes (a slot's, as the stage holds them without recomputation).
  template <class P, typename T>
  static size_t block_bytes(const ParamLayout& lay, int B, int Tn) {
    BlockActs<T> a;
    return buffer_bytes([&](auto fn) { block_buffers<P>(a, lay, B, Tn, fn); });
  }
  template <class P, class A, class Fn>
  static void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
    L::head(lay).template buffers<P>(a, lay, B, Tn, fn);
  }
  static size_t wide(const ParamLayout& lay) {
    const BlockLayers<Mlp> b = L::block(lay, -1);
    return std::max(size_t(b.attn.qkv_width()), b.mlp.wide());
  }
  static size_t attention_row(const ParamLayout& lay) { return L::block(lay, -1).attn.widened_row(); }
  template <class P, class S, class Fn>
  static void scratch_buffers(const ParamLayout& lay, int B, int Tn, S& s, Fn&& fn) {
    const BlockLayers<Mlp> b = L::block(lay, -1);
    b.mlp.template scratch_buffers<P>(size_t(B) * Tn, s, fn);
    b.attn.scratch_buffers(Tn, s, fn);
  }
  template <typename T>
  static void prepare(const ParamLayout& lay, int Tn, BackwardScratch<T>& s) {
    L::block(lay, -1).attn.prepare(lay, Tn, s);
  }
  template <typename T>
  static const T* block_output(const BlockActs<T>& a) {
    return a.res3.data();
  }
  // What an MLP that reports (the MoE layer: its balancing loss and expert loads) reported in the
  // block's last forward; stage_impl.h calls it when the MLP has it.
  template <typename T>
    requires requires(const typename Mlp::template Acts<T>& m) { Mlp::note(m, nullptr, nullptr); }
  static void moe_note(const BlockActs<T>& a, double* aux, double* loads) {
    Mlp::note(a.mlp, aux, loads);
  }
  // The counts per layer that MLP reports into (Mlp::report_row), 0 for an MLP that reports none.
  static size_t report_row(const Config& c) {
    if constexpr (requires { Mlp::report_row(c); }) return Mlp::report_row(c);
    else return 0;
  }

  template <typename T>
  static void embed_forward(const ParamLayout& lay, const WeightView<T>& p, const int32_t* tok, T* out, int B,
                            int Tn, tp::Region& tp) {
    L::embedding(lay).forward(lay, p, tok, out, B, Tn, tp);
  }
  template <typename T>
  static void embed_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok,
                             int B, int Tn) {
    L::embedding(lay).backward(lay, g, dout, tok, B, Tn);
  }

  // Each norm's output is computed where the policy says (its SavedInput, or dtmp) and multiplied
  // as keep() returns it.
  template <class P, typename T>
  static void block_forward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                            BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
    const BlockLayers<Mlp> b = L::block(lay, layer);
    const SeqRows r(lay, B, Tn);
    const size_t NC = r.N * lay.config().d_model;
    T* x = pol.output(a.ln1, s.dtmp.data());
    b.norm1.forward(x, a.n1, in, p, r, tp);
    const auto ln1 = pol.keep(a.ln1, x, NC);
    b.attn.forward(pol, a.attn, ln1, a.res2.data(), in, p, s, r, B, Tn, tp);
    x = pol.output(a.ln2, s.dtmp.data());
    b.norm2.forward(x, a.n2, a.res2.data(), p, r, tp);
    const auto ln2 = pol.keep(a.ln2, x, NC);
    b.mlp.forward(pol, a.mlp, ln2, a.res3.data(), a.res2.data(), p, s, r, Tn, tp);
  }

  // Selective recomputation (Config::recompute_selective): the matmul inputs that are cheap to
  // compute again and as large as what they come from (the norms' outputs, from the kept input and
  // res2; the MLP's selective ones, e.g. the GELU's output) are not kept per block; before a
  // block's backward they are computed again exactly as block_forward computed them, into the
  // stage's one shared set. Under sequence parallelism the norms' gathered outputs are never kept
  // per block either: a kept copy of this rank's rows would have to be gathered again all the
  // same, so recompute_inputs computes the rows again (a pass over N/tp x C) and gathers.
  template <class A>
  static auto selective_inputs(A& a) {
    const auto m = Mlp::selective(a.mlp);
    std::array<decltype(&a.ln1), 2 + std::tuple_size_v<decltype(m)>> v{&a.ln1, &a.ln2};
    for (size_t i = 0; i < m.size(); ++i) v[2 + i] = m[i];
    return v;
  }
  template <class A>
  static auto gathered_inputs(A& a) {
    return std::array{&a.ln1, &a.ln2};
  }
  template <class P, typename T>
  static void recompute_inputs(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p, const T* in,
                               BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                               bool selective) {
    const BlockLayers<Mlp> b = L::block(lay, layer);
    const SeqRows r(lay, B, Tn);
    const size_t NC = r.N * lay.config().d_model;
    T* x = pol.output(a.ln1, s.dtmp.data());
    b.norm1.forward(x, a.n1, in, p, r, tp);
    pol.keep(a.ln1, x, NC);
    x = pol.output(a.ln2, s.dtmp.data());
    b.norm2.forward(x, a.n2, a.res2.data(), p, r, tp);
    pol.keep(a.ln2, x, NC);
    if (selective) b.mlp.recompute(pol, a.mlp, s, int(r.N));
  }

  // An output gradient is spent (may be rounded in place) when only its matmul reads it
  // afterwards; the residual gradient dres is kept. An input-only pass (zero-bubble schedules)
  // computes no matmul weight gradient and keeps the output gradients for backward_weights.
  template <class P, typename T>
  static void block_backward(const P& pol, const ParamLayout& lay, int layer, const WeightView<T>& p,
                             const GradView<T>& g, const T* in, BlockActs<T>& a, T* dres, BackwardScratch<T>& s,
                             int B, int Tn, tp::Region& tp, const std::function<void(size_t)>& done,
                             BackwardPart part) {
    const BlockLayers<Mlp> b = L::block(lay, layer);
    const SeqRows r(lay, B, Tn);
    const size_t C = lay.config().d_model, NC = r.N * C;
    const int N = int(r.N);
    T* dtmp = s.dtmp.data();
    T* dbig = s.dbig.data();
    const bool full = part == BackwardPart::kFull;
    const GradView<T>* gw = full ? &g : nullptr;  // the matmuls' weight gradients, in a full pass only
    // The gradient of a row-parallel layer's output: dres, or under sequence parallelism all N
    // rows of it gathered into s.seq, a copy its matmul may round in place.
    auto out_grad = [&](T* spare) {
      if (!r.split) return OutGrad<T>::kept(dres, spare);
      gather_rows(r, tp, dres, s.seq.data(), C);
      return OutGrad<T>::spent(s.seq.data());
    };
    // Only a full pass finalises tensors: after an input-only one the weights are still to come.
    auto done_if_full = [&](size_t end) {
      if (full) done(end);
    };
    // res3 = res2 + mlp(norm2(res2)); dtmp is free until the MLP's input gradient: it may take
    // the rounded dres.
    b.mlp.backward(pol, a.mlp, gw, out_grad(dtmp), dtmp, pol.saved(a.ln2), s, N, Tn, tp, !full, done_if_full);
    // Column-parallel: the input gradient is a sum over the shards (this rank's rows of it under
    // sequence parallelism).
    const T* dln = reduce_rows(r, tp, dtmp, C);
    done_if_full(b.norm2.w);
    b.norm2.backward(dres, dln, a.res2.data(), a.n2, p, g, r, tp, s.dnorm);
    done_if_full(b.attn.out.w);
    // res2 = in + attention(norm1(in)); dbig is free until the attention's gradient: it may take
    // the rounded dres when it is wide enough.
    b.attn.backward(pol, a.attn, gw, out_grad(s.dbig.size() >= NC ? dbig : nullptr), dtmp, pol.saved(a.ln1), s, B,
                    Tn, !full, done_if_full);
    dln = reduce_rows(r, tp, dtmp, C);
    done_if_full(b.norm1.w);
    b.norm1.backward(dres, dln, in, a.n1, p, g, r, tp, s.dnorm);
    done_if_full(b.end);
  }

  // The matmuls' weight gradients (and biases) from the kept output gradients, in a full
  // backward's order.
  template <class P, typename T>
  static void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, const GradView<T>& g,
                                     const BlockActs<T>& a, BackwardScratch<T>& s, int B, int Tn) {
    const BlockLayers<Mlp> b = L::block(lay, layer);
    const int N = B * Tn;
    b.mlp.backward_weights(pol, a.mlp, g, pol.saved(a.ln2), s, N);
    b.attn.backward_weights(pol, a.attn, g, pol.saved(a.ln1), N);
  }

  template <class P, typename T>
  static double head_forward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const T* in,
                             const int32_t* targets, HeadActs<T>& a, BackwardScratch<T>& s, int B, int Tn,
                             tp::Region& tp) {
    return L::head(lay).forward(pol, lay, p, in, targets, a, s, B, Tn, tp);
  }
  template <class P, typename T>
  static void head_backward(const P& pol, const ParamLayout& lay, const WeightView<T>& p, const GradView<T>& g,
                            const T* in, HeadActs<T>& a, T loss_scale, T* dres, BackwardScratch<T>& s, int B, int Tn,
                            tp::Region& tp) {
    L::head(lay).backward(pol, lay, p, g, in, a, loss_scale, dres, s, B, Tn, tp);
  }
};

}  // namespace trn::model
