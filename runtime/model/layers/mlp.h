// The MLPs of a block (layers/README.md): a column-parallel input projection, an activation, and
// the row-parallel output projection with the residual. GeluMlp: fc -> GELU -> proj (GPT-2).
// SwigluMlp: [gate | up] in one product (their weights adjacent) -> silu(gate) * up -> down
// (Llama). Each is a type with the same members, so a block composes either (layers/block.h):
//
//   params(), weights() (the matmuls'), flops_per_token(), kActivationOps (per hidden element,
//   what selective recomputation reruns: the planner's charge)
//   Acts<T>, buffers<P>(a, N, B, fn) (N rows of B sequences), scratch_buffers<P>(N, s, fn), wide()
//   forward(pol, a, x, res, residual, p, s, r, Tn, tp)
//   backward(pol, a, g, d, dx, x, s, N, Tn, tp, keep, done_out), backward_weights(pol, a, g, x, s, N)
//     (g: the weights' gradients, null in an input-only pass)
//   selective(a): the SavedInputs selective recomputation computes again; recompute(pol, a, s, N)
#pragma once

#include <array>
#include <cstddef>
#include <utility>
#include <vector>

#include "runtime/model/layers/linear.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"

namespace trn::model {

struct GeluMlp {
  Linear fc, proj;  // fc: d_model -> F (this rank's), proj: F -> d_model
  int F = 0;

  size_t params() const { return fc.params() + proj.params(); }
  size_t weights() const { return fc.weights() + proj.weights(); }
  double flops_per_token() const { return fc.flops_per_token() + proj.flops_per_token(); }
  // Operations per hidden element of the activation (for selective recomputation's cost).
  static constexpr double kActivationOps = 20;
  size_t wide() const { return size_t(F); }

  // pre: the GELU's input; act: its output (proj's input), kept or computed again (selective);
  // d_proj, d_fc: the output gradients kept by an input-only backward.
  template <typename T>
  struct Acts {
    std::vector<T> pre;
    SavedInput<T> act;
    std::vector<T> d_proj, d_fc;
  };
  template <class P, class A, class Fn>
  void buffers(A& a, size_t N, int, Fn&& fn) const {
    fn(a.pre, N * F);
    P::reserve(a.act, N * F, fn);
  }
  template <class P, class S, class Fn>
  void scratch_buffers(size_t, S&, Fn&&) const {}
  template <class A>
  static auto selective(A& a) {
    return std::array{&a.act};
  }

  template <class P, typename T>
  void forward(const P& pol, Acts<T>& a, typename P::Operand x, T* res, const T* residual, const WeightView<T>& p,
               BackwardScratch<T>& s, const SeqRows& r, int /*Tn*/, tp::Region& tp) const {
    const int N = int(r.N);
    fc.forward(pol, a.pre.data(), x, p, N);  // column-parallel
    const auto act = activation(pol, a, s, N);
    row_parallel_forward(pol, proj, res, act, p, residual, r, s, tp);
  }
  template <class P, typename T>
  void recompute(const P& pol, Acts<T>& a, BackwardScratch<T>& s, int N) const {
    activation(pol, a, s, N);
  }

  // d: proj's output gradient; dx (dtmp): the input gradient, partial over the tensor-parallel
  // ranks. done_out(offset): called after proj's backward with the first offset not yet final.
  // keep: an input-only pass, which keeps the output gradients for backward_weights.
  template <class P, typename T, class Done>
  void backward(const P& pol, Acts<T>& a, const GradView<T>* g, OutGrad<T> d, T* dx, typename P::Operand x,
                BackwardScratch<T>& s, int N, int /*Tn*/, tp::Region& /*tp*/, bool keep, Done&& done_out) const {
    T* dbig = s.dbig.data();
    if (keep) a.d_proj.assign(d.d, d.d + size_t(N) * proj.out);
    proj.backward(pol, dbig, g, d, pol.saved(a.act), pol.weight(proj.w), N);
    done_out(fc.w);
    ops::gelu_backward(dbig, a.pre.data(), dbig, size_t(N) * F);
    if (keep) a.d_fc.assign(dbig, dbig + size_t(N) * F);
    fc.backward(pol, dx, g, OutGrad<T>::spent(dbig), x, pol.weight(fc.w), N);
  }
  template <class P, typename T>
  void backward_weights(const P& pol, const Acts<T>& a, const GradView<T>& g, typename P::Operand x,
                        BackwardScratch<T>&, int N) const {
    const typename P::Operand no_w{};
    T* none = nullptr;
    proj.backward(pol, none, &g, OutGrad<T>::kept(a.d_proj.data()), pol.saved(a.act), no_w, N);
    fc.backward(pol, none, &g, OutGrad<T>::kept(a.d_fc.data()), x, no_w, N);
  }

 private:
  // The GELU's output where the policy computes it (its SavedInput, or dbig), as it multiplies it.
  template <class P, typename T>
  typename P::Operand activation(const P& pol, Acts<T>& a, BackwardScratch<T>& s, int N) const {
    T* y = pol.output(a.act, s.dbig.data());
    ops::gelu_forward(y, a.pre.data(), size_t(N) * F);
    return pol.keep(a.act, y, size_t(N) * F);
  }
};

struct SwigluMlp {
  Linear gate_up, down;  // gate_up: d_model -> 2F ([gate | up], this rank's), down: F -> d_model
  int F = 0;

  size_t params() const { return gate_up.params() + down.params(); }
  size_t weights() const { return gate_up.weights() + down.weights(); }
  double flops_per_token() const { return gate_up.flops_per_token() + down.flops_per_token(); }
  static constexpr double kActivationOps = 0;  // nothing recomputed selectively (see Acts)
  // 2F: gate and up's output, and the bf16 scratch that rounds their gradient.
  size_t wide() const { return 2 * size_t(F); }

  // gu: gate and up before the SwiGLU. down's input, silu(gate) * up, is computed again from gu
  // where backward needs it (a pass over N x F values, where keeping it would hold as many).
  template <typename T>
  struct Acts {
    std::vector<T> gu;
    std::vector<T> d_down, d_gu;
  };
  template <class P, class A, class Fn>
  void buffers(A& a, size_t N, int, Fn&& fn) const {
    fn(a.gu, N * 2 * F);
  }
  // s.extra: down's input, then gate and up's gradient (N x 2F).
  template <class P, class S, class Fn>
  void scratch_buffers(size_t N, S& s, Fn&& fn) const {
    fn(s.extra, N * 2 * F);
  }
  template <class A>
  static auto selective(A&) {
    return std::array<std::nullptr_t, 0>{};
  }

  template <class P, typename T>
  void forward(const P& pol, Acts<T>& a, typename P::Operand x, T* res, const T* residual, const WeightView<T>& p,
               BackwardScratch<T>& s, const SeqRows& r, int /*Tn*/, tp::Region& tp) const {
    const int N = int(r.N);
    gate_up.forward(pol, a.gu.data(), x, p, N);  // column-parallel
    row_parallel_forward(pol, down, res, input(pol, a, s, N), p, residual, r, s, tp);
  }
  template <class P, typename T>
  void recompute(const P&, Acts<T>&, BackwardScratch<T>&, int) const {}

  template <class P, typename T, class Done>
  void backward(const P& pol, Acts<T>& a, const GradView<T>* g, OutGrad<T> d, T* dx, typename P::Operand x,
                BackwardScratch<T>& s, int N, int /*Tn*/, tp::Region& /*tp*/, bool keep, Done&& done_out) const {
    T* dbig = s.dbig.data();
    T* dgu = s.extra.data();
    if (keep) a.d_down.assign(d.d, d.d + size_t(N) * down.out);
    down.backward(pol, dbig, g, d, input(pol, a, s, N), pol.weight(down.w), N);
    done_out(gate_up.w);
    ops::swiglu_backward(dgu, dbig, a.gu.data(), N, F);
    if (keep) a.d_gu.assign(dgu, dgu + size_t(N) * 2 * F);
    gate_up.backward(pol, dx, g, OutGrad<T>::spent(dgu), x, pol.weight(gate_up.w), N);
  }
  template <class P, typename T>
  void backward_weights(const P& pol, const Acts<T>& a, const GradView<T>& g, typename P::Operand x,
                        BackwardScratch<T>& s, int N) const {
    const typename P::Operand no_w{};
    T* none = nullptr;
    down.backward(pol, none, &g, OutGrad<T>::kept(a.d_down.data()), input(pol, a, s, N), no_w, N);
    gate_up.backward(pol, none, &g, OutGrad<T>::kept(a.d_gu.data()), x, no_w, N);
  }

 private:
  // down's input from gu, in s.extra (free in forward, and in backward until gate and up's
  // gradient), as the policy multiplies it.
  template <class P, typename T>
  typename P::Operand input(const P& pol, const Acts<T>& a, BackwardScratch<T>& s, int N) const {
    T* y = s.extra.data();
    ops::swiglu_forward(y, a.gu.data(), N, F);
    SavedInput<T> none;  // nothing kept: the policy rounds in place where it rounds
    return pol.keep(none, y, size_t(N) * F);
  }
};

}  // namespace trn::model
