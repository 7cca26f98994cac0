// The mixture-of-experts layer (the MLP of a Mixtral block; the maths in runtime/kernels/moe.h):
// a router, then each token's top-k SwiGLU experts over grouped rows, combined with the routing
// weights. It has the members of the MLP layers (layers/mlp.h), so a block composes it in an MLP's
// place (layers/block.h).
//
// Tensor parallelism: each expert is split by tp like a dense SwiGLU MLP (w1, w3 by rows, w2 by
// columns), the router is replicated and sees the same (gathered) rows on every tp rank, so every
// tp rank routes alike; the combine is linear in the experts' partial outputs and is summed once
// like a row-parallel output. The combine weights' gradients are dot products with partial
// outputs, so they are summed over tp before the router's backward, whose input gradient is added
// on tp rank 0 only (the block sums the input gradient over tp).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/moe.h"
#include "runtime/model/layers/linear.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"

namespace trn::model {

struct MoeMlp {
  Linear router;       // d_model -> E, replicated ([E, C]: block_sparse_moe.gate.weight)
  size_t down0 = 0;    // expert 0's w2 (C x F); expert e's at down0 + e * stride
  size_t gate_up0 = 0; // expert 0's w1 then w3 (2F x C, adjacent: one product gives [gate | up])
  size_t stride = 0;   // elements between one expert's tensors and the next's
  size_t bias = 0;     // the balancing bias (E), or 0 without Config::moe_bias
  int C = 0, F = 0, E = 0, k = 0;  // F: this rank's share of an expert's hidden width
  bool norm_topk = true;
  double capacity = 0;

  size_t params() const { return router.params() + size_t(E) * 3 * size_t(C) * F + (bias ? size_t(E) : 0); }
  // The matmul weights a token multiplies (the planner's compute): the router and k experts'.
  size_t weights() const { return router.params() + size_t(k) * 3 * size_t(C) * F; }
  // By the active parameters: a token runs the router and k experts.
  double flops_per_token() const { return router.flops_per_token() + 6.0 * k * 3 * double(C) * F; }
  static constexpr double kActivationOps = 0;  // nothing recomputed selectively
  // 2F: the experts' [gate | up] rows; E: the router's logits, whose gradient a bf16 policy may
  // round in its own scratch (N x the widest output).
  size_t wide() const { return std::max(2 * size_t(F), size_t(E)); }

  // route: the routing; probs (N x E) the router's probabilities; xs the experts' inputs grouped
  // by expert, hs their [gate | up] rows and ys their outputs (partial sums over tp); aux this
  // forward's balancing loss summed over its sequences. Sized for every choice kept (N x k rows).
  template <typename T>
  struct Acts {
    kernels::moe::Routing<T> route;
    std::vector<T> probs, hs, ys;
    SavedInput<T> xs;
    double aux = 0;
  };
  template <class P, class A, class Fn>
  void buffers(A& a, size_t N, Fn&& fn) const {
    const size_t rows = N * size_t(k);
    fn(a.probs, N * size_t(E));
    P::reserve(a.xs, rows * C, fn);
    fn(a.hs, rows * 2 * F);
    fn(a.ys, rows * C);
  }
  // s.extra, carved by Scratch below.
  template <class S, class Fn>
  void scratch_buffers(size_t N, S& s, Fn&& fn) const {
    const size_t rows = N * size_t(k);
    fn(s.extra, rows * (2 * size_t(C) + 4 * size_t(F)) + N * (size_t(E) + size_t(k) + size_t(C)));
  }
  template <class A>
  static auto selective(A&) {
    return std::array<std::nullptr_t, 0>{};
  }
  template <class P, typename T>
  void recompute(const P&, Acts<T>&, BackwardScratch<T>&, int) const {}

  // The balancing loss of the last forward into *aux, each expert's kept choices and the dropped
  // ones into loads (E + 1).
  template <typename T>
  static void note(const Acts<T>& a, double* aux, double* loads) {
    *aux += a.aux;
    for (int e = 0; e < a.route.E; ++e) loads[e] += double(a.route.load(e));
    loads[a.route.E] += double(a.route.dropped);
  }

  // res (this rank's rows) = residual + the tp sum of combine(experts(route(x))). x: the norm's
  // output as the policy multiplies it (all N rows), Tn tokens per sequence.
  template <class P, typename T>
  void forward(const P& pol, Acts<T>& a, typename P::Operand x, T* res, const T* residual, const WeightView<T>& p,
               BackwardScratch<T>& s, const SeqRows& r, int Tn, tp::Region& tp) const {
    namespace moe = kernels::moe;
    const int N = int(r.N);
    const Scratch<T> m(*this, s, r.N);
    router.forward(pol, m.logits, x, p, N);
    moe::softmax_rows(a.probs.data(), m.logits, N, E);
    moe::route(a.route, a.probs.data(), bias ? p.f32(bias, size_t(E)) : nullptr, N, {E, k, norm_topk, capacity, Tn});
    const int G = a.route.rows();
    T* xs = pol.output(a.xs, m.rows_c);
    gather(xs, x, a.route);
    const auto xs_op = pol.keep(a.xs, xs, size_t(G) * C);
    for_each_expert(a, [&](int e, int from, int n) {
      pol.linear_forward(a.hs.data() + size_t(from) * 2 * F, xs_op + size_t(from) * C, pol.weight(gate_up0 + e * stride),
                         n, C, 2 * F);
    });
    ops::swiglu_forward(m.act, a.hs.data(), G, F);
    SavedInput<T> none;  // nothing kept: the policy rounds in place where it rounds
    const auto act = pol.keep(none, m.act, size_t(G) * F);
    for_each_expert(a, [&](int e, int from, int n) {
      pol.linear_forward(a.ys.data() + size_t(from) * C, act + size_t(from) * F, pol.weight(down0 + e * stride), n, F,
                         C);
    });
    T* partial = r.split ? s.seq.data() : res;
    moe::combine(partial, a.ys.data(), a.route, C);
    const T* sums = reduce_rows(r, tp, partial, size_t(C));
    for (size_t i = 0; i < r.local * C; ++i) res[i] = sums[i] + residual[i];
    std::vector<T> per_sequence(size_t(N / Tn));
    a.aux = double(moe::aux_forward(per_sequence.data(), a.probs.data(), a.route, Tn));
  }

  // d: the output gradient (all N rows); dx (overwritten): this rank's part of the input
  // gradient (summed over tp by the block). done_out(router) once the experts' gradients are
  // final. A full backward only (parallel::check refuses zero-bubble with MoE).
  template <class P, typename T, class Done>
  void backward(const P& pol, Acts<T>& a, const GradView<T>* g, OutGrad<T> d, T* dx, typename P::Operand x,
                BackwardScratch<T>& s, int N, int Tn, tp::Region& tp, bool /*keep*/, Done&& done_out) const {
    namespace moe = kernels::moe;
    TRN_CHECK(g != nullptr);
    const Scratch<T> m(*this, s, size_t(N));
    const int G = a.route.rows();
    T* dys = m.rows_c;
    moe::combine_backward(dys, m.dweight, d.d, a.ys.data(), a.route, C);
    if (tp.size() > 1) tp.sum(m.dweight, size_t(N) * k);
    ops::swiglu_forward(m.act, a.hs.data(), G, F);
    SavedInput<T> none;
    const auto act = pol.keep(none, m.act, size_t(G) * F);
    for_each_expert(a, [&](int e, int from, int n) {
      pol.linear_backward(m.dact + size_t(from) * F, g->at(down0 + e * stride),
                          OutGrad<T>::spent(dys + size_t(from) * C), act + size_t(from) * F,
                          pol.weight(down0 + e * stride), n, F, C);
    });
    ops::swiglu_backward(m.dhs, m.dact, a.hs.data(), G, F);
    const auto xs = pol.saved(a.xs);
    for_each_expert(a, [&](int e, int from, int n) {
      pol.linear_backward(m.dxs + size_t(from) * C, g->at(gate_up0 + e * stride),
                          OutGrad<T>::spent(m.dhs + size_t(from) * 2 * F), xs + size_t(from) * C,
                          pol.weight(gate_up0 + e * stride), n, C, 2 * F);
    });
    done_out(router.w);
    std::fill(dx, dx + size_t(N) * C, T(0));
    moe::scatter_add(dx, m.dxs, a.route, C);
    moe::router_backward(m.logits, m.dweight, a.probs.data(), a.route, norm_topk, Tn, s.aux_scale);
    router.backward(pol, m.dx_router, g, OutGrad<T>::spent(m.logits), x, pol.weight(router.w), N);
    if (tp.rank() == 0)
      for (size_t i = 0; i < size_t(N) * C; ++i) dx[i] += m.dx_router[i];
  }
  template <class P, typename T>
  void backward_weights(const P&, const Acts<T>&, const GradView<T>&, typename P::Operand, BackwardScratch<T>&,
                        int) const {
    TRN_CHECK(false && "zero-bubble's weight pass with MoE (parallel::check refuses it)");
  }

 private:
  // The layer's scratch in s.extra (scratch_buffers sizes it); rows = N x k.
  template <typename T>
  struct Scratch {
    T* rows_c;     // rows x C: the grouped inputs before a bf16 policy keeps them; dys in backward
    T* act;        // rows x F: silu(gate) * up
    T* dact;       // rows x F
    T* dhs;        // rows x 2F
    T* dxs;        // rows x C
    T* logits;     // N x E: the router's logits; their gradient in backward
    T* dweight;    // N x k
    T* dx_router;  // N x C
    Scratch(const MoeMlp& l, BackwardScratch<T>& s, size_t N) {
      const size_t rows = N * size_t(l.k), C = size_t(l.C), F = size_t(l.F);
      T* at = s.extra.data();
      auto take = [&](size_t n) {
        T* q = at;
        at += n;
        return q;
      };
      rows_c = take(rows * C);
      act = take(rows * F);
      dact = take(rows * F);
      dhs = take(rows * 2 * F);
      dxs = take(rows * C);
      logits = take(N * size_t(l.E));
      dweight = take(N * size_t(l.k));
      dx_router = take(N * C);
    }
  };

  // fn(expert, first grouped row, rows) for each expert with rows.
  template <typename T, class Fn>
  void for_each_expert(const Acts<T>& a, Fn&& fn) const {
    for (int e = 0; e < E; ++e) {
      const int from = a.route.offset[size_t(e)], n = a.route.offset[size_t(e) + 1] - from;
      if (n > 0) fn(e, from, n);
    }
  }

  // xs (rows x C): each grouped row its token's row of x, read from the operand the norm's output
  // is multiplied as (the values themselves, or their bf16 rounding: a matmul input is rounded
  // the same before or after the gather).
  template <typename T>
  void gather(T* xs, const T* x, const kernels::moe::Routing<T>& route) const {
    kernels::moe::gather(xs, x, route, C);
  }
  void gather(float* xs, const kernels::Bf16Src& x, const kernels::moe::Routing<float>& route) const {
    for (int row = 0; row < route.rows(); ++row) {
      const size_t from = size_t(route.token[size_t(row)]) * C;
      float* o = xs + size_t(row) * C;
      if (x.f) std::copy_n(x.f + from, C, o);
      else
        for (int c = 0; c < C; ++c) o[c] = kernels::from_bf16(x.h[from + size_t(c)]);
    }
  }
};

}  // namespace trn::model
