// LayerNorm (weight and bias, GPT-2) and RMSNorm (weight only, Llama) over d_model, as a block or
// the head runs them (layers/README.md): over this rank's token rows, the output gathered under
// sequence parallelism for the column-parallel layer after it, the weight gradients summed over
// the tensor-parallel group there.
#pragma once

#include <cstddef>
#include <vector>

#include "runtime/kernels/ref.h"
#include "runtime/model/layers.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"
#include "runtime/model/views.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::model {

enum class NormKind { kLayerNorm, kRMSNorm };

struct Norm {
  NormKind kind = NormKind::kLayerNorm;
  int C = 0;
  float eps = 1e-5f;    // RMSNorm's (the LayerNorm kernel's is fixed at 1e-5, as GPT-2's)
  size_t w = 0, b = 0;  // offsets; b for LayerNorm only

  bool has_bias() const { return kind == NormKind::kLayerNorm; }
  size_t params() const { return has_bias() ? 2 * size_t(C) : size_t(C); }
  // Per token row: the saved statistics (mean and 1/std, or 1/rms) in elements, and the
  // operations of forward and backward (about 8 per element).
  size_t stats_per_row() const { return has_bias() ? 2 : 1; }
  double flops_per_token() const { return 8.0 * C; }

  // The statistics of one pass over this rank's rows (mean empty for RMSNorm).
  template <typename T>
  struct Acts {
    std::vector<T> mean, rstd;
  };
  template <class A, class Fn>
  void buffers(A& a, size_t rows, Fn&& fn) const {
    if (has_bias()) fn(a.mean, rows);
    fn(a.rstd, rows);
  }

  // x (N x C) at this rank's rows = norm(in) (those rows), then all N gathered under sequence
  // parallelism: the input of the column-parallel layer after it.
  template <typename T>
  void forward(T* x, Acts<T>& a, const T* in, const WeightView<T>& p, const SeqRows& r, tp::Region& tp) const {
    if (has_bias())
      kernels::ref::layernorm_forward(x + r.first * C, a.mean.data(), a.rstd.data(), in, p.f32(w), p.f32(b),
                                      int(r.local), C);
    else
      ops::rmsnorm_forward(x + r.first * C, a.rstd.data(), in, p.f32(w), int(r.local), C, eps);
    if (r.split) tp.gather(x, r.local * C);
  }

  // dres (this rank's rows) += the input gradient from dln (those rows: the column-parallel
  // layer's input gradient, summed); the weight (and bias) gradients added to g (norm_weight_grads).
  template <typename T>
  void backward(T* dres, const T* dln, const T* in, const Acts<T>& a, const WeightView<T>& p, const GradView<T>& g,
                const SeqRows& r, tp::Region& tp, std::vector<T>& scratch) const {
    const int Nl = int(r.local);
    norm_weight_grads(r, tp, scratch, g.at(w), has_bias() ? g.at(b) : static_cast<T*>(nullptr), size_t(C),
                      [&](T* dw, T* db) {
                        if (has_bias())
                          kernels::ref::layernorm_backward(dres, dw, db, dln, in, p.f32(w), a.mean.data(),
                                                           a.rstd.data(), Nl, C);
                        else
                          ops::rmsnorm_backward(dres, dw, dln, in, p.f32(w), a.rstd.data(), Nl, C);
                      });
  }
};

}  // namespace trn::model
