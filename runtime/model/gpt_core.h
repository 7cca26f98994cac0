// The GPT-2 forward and backward pass over one slice of the batch, with the activations of that
// slice allocated once. Templated on the element type: GptCore<float> runs the fast kernels and
// is what Gpt uses (one core per compute thread); GptCore<double> runs the reference kernels in
// double precision, which the tests check against finite differences.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/model/config.h"

namespace trn::model {

template <typename T>
class GptCore {
 public:
  // Activations for `batch` sequences of `seq_len` tokens (seq_len <= c.ctx).
  GptCore(const Config& c, const ParamLayout& layout, int batch, int seq_len);

  int batch() const { return B_; }
  int seq_len() const { return T_; }

  // inputs and targets are (B,T) token ids. Returns the sum (not the mean) of the B*T token
  // losses; targets may be null to skip the loss (logits are then left in probs()).
  double forward(const T* params, const int32_t* inputs, const int32_t* targets);

  // Adds d(loss_scale * sum of token losses)/d(params) into grads. Needs the forward just run.
  // After each group of tensors is final, calls prefix_done(n) with the number of leading
  // elements of the gradient buffer that this backward will not touch again.
  void backward(const T* params, T* grads, T loss_scale,
                const std::function<void(size_t)>& prefix_done);

  const T* probs() const { return probs_.data(); }      // (B,T,V) after forward
  const T* losses() const { return losses_.data(); }    // (B,T)
  size_t activation_bytes() const;

 private:
  struct Layer {
    std::vector<T> ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, res3;
  };
  const T* layer_input(int l) const;

  Config c_;
  const ParamLayout& lay_;
  int B_, T_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<T> encoded_, lnf_, lnf_mean_, lnf_rstd_, probs_, losses_;
  std::vector<Layer> layers_;
  // backward scratch, reused by every layer
  std::vector<T> dres_, dtmp_, dbig_, datt_;
};

extern template class GptCore<float>;
extern template class GptCore<double>;

}  // namespace trn::model
