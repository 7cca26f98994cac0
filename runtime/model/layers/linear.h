// A block's linear layer (layers/README.md): its weight's orientation and offsets in the buffer,
// and the row-parallel pattern every block's output projections share. The layers of this
// directory call it; a family never does.
#pragma once

#include <cstddef>
#include <cstring>

#include "runtime/model/layers.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"
#include "runtime/model/views.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::model {

// How a family stores a linear weight: Hugging Face GPT-2's Conv1D [in, out] (y = x W + b, the
// matmul_* kernels) or nn.Linear's [out, in] (y = x W^T + b, the linear_* kernels). The
// orientation picks the kernels; the values mean the same either way.
enum class Orientation { kInOut, kOutIn };

// y (N, out) = x (N, in) @ W (+ b), over this rank's widths. A bias gradient is summed with the
// weight gradient (in a full backward and in a zero-bubble weight pass), from the unrounded
// output gradient.
struct Linear {
  Orientation orient = Orientation::kOutIn;
  size_t w = 0, b = 0;  // offsets; b only with bias
  bool bias = false;
  int in = 0, out = 0;  // this rank's input and output widths

  size_t weights() const { return size_t(in) * out; }
  size_t params() const { return weights() + (bias ? size_t(out) : 0); }
  double flops_per_token() const { return 6.0 * in * out; }  // forward + both backward products

  template <class P, typename T>
  void forward(const P& pol, T* y, typename P::Operand x, const WeightView<T>& p, int N) const {
    if (orient == Orientation::kInOut) {
      pol.matmul_forward(y, x, pol.weight(w), bias ? p.f32(b) : static_cast<const T*>(nullptr), N, in, out);
      return;
    }
    pol.linear_forward(y, x, pol.weight(w), N, in, out);
    if (bias) ops::add_bias(y, p.f32(b, size_t(out)), N, out);
  }

  // dx (unless null) = d @ W^T; with g (a full or weight pass) dW += x^T d and db += column sums.
  // w_op: the weight as the policy multiplies it (P::Operand{} for a weight pass).
  template <class P, typename T>
  void backward(const P& pol, T* dx, const GradView<T>* g, OutGrad<T> d, typename P::Operand x,
                typename P::Operand w_op, int N) const {
    T* dw = g ? g->at(w) : nullptr;
    if (orient == Orientation::kInOut) {
      // (matmul_backward sums the bias only with dw)
      pol.matmul_backward(dx, dw, bias && g ? g->at(b) : nullptr, d, x, w_op, N, in, out);
      return;
    }
    if (bias && g) {
      T* db = g->at(b, size_t(out));
      for (int n = 0; n < N; ++n) {
        const T* dn = d.d + size_t(n) * out;
        for (int j = 0; j < out; ++j) db[j] += dn[j];
      }
    }
    pol.linear_backward(dx, dw, d, x, w_op, N, in, out);
  }
};

// A row-parallel linear layer and the residual after it: out = all-reduce(x (N, in) @ W) + b +
// residual, over this rank's rows r (out and residual hold those; the product of all N goes
// through s.seq under sequence parallelism, whose reduce-scatter replaces the all-reduce). With
// one rank the bias rides the matmul; otherwise it is added once, after the sum.
template <class P, typename T>
void row_parallel_forward(const P& pol, const Linear& lin, T* out, typename P::Operand x, const WeightView<T>& p,
                          const T* residual, const SeqRows& r, BackwardScratch<T>& s, tp::Region& tp) {
  const int N = int(r.N), OC = lin.out;
  if (tp.size() == 1 && !r.split) {
    lin.forward(pol, out, x, p, N);
  } else {
    T* partial = r.split ? s.seq.data() : out;
    Linear no_bias = lin;
    no_bias.bias = false;
    no_bias.forward(pol, partial, x, p, N);
    const T* sums = reduce_rows(r, tp, partial, size_t(OC));
    if (sums != out) std::memcpy(out, sums, sizeof(T) * r.local * OC);
    if (lin.bias) ops::add_bias(out, p.f32(lin.b, size_t(OC)), int(r.local), OC);
  }
  const size_t n = r.local * OC;
  for (size_t i = 0; i < n; ++i) out[i] += residual[i];
}

}  // namespace trn::model
