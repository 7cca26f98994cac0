// Pieces every family's embedding and head share: the vocabulary-parallel token embedding and
// the vocabulary-parallel cross-entropy (Megatron's split: each tensor-parallel rank holds
// local_vocab() rows of the padded vocabulary; the [B, T, V] logits are never gathered, and
// padding rows never enter the softmax).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/model/stage.h"
#include "runtime/model/views.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::model {

// out (N,C) = table[tok] for this rank's rows of the vocabulary (others add 0), summed over the
// tensor-parallel group: exactly one rank holds each token's row. Under sequence parallelism
// reduce-scattered instead (reduce_rows): only this rank's rows, at out + first x C, are whole. The table is the layout's
// embedding tensor (ParamLayout::embedding), read whole from the master form of w.
template <typename T>
void embed_tokens(const ParamLayout& lay, const WeightView<T>& w, const int32_t* tok, T* out, size_t N,
                  tp::Region& tp);
// dtable (this rank's rows, at ParamLayout::embedding in g) += dout (N,C) at the tokens' rows.
template <typename T>
void embed_tokens_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok,
                           size_t N);

// logits (N, local_vocab) become the softmax probabilities in place and losses (N) the token
// losses against targets (kept in saved_targets for backward); returns their sum. Under tensor
// parallelism the row maximum and the sums of exponentials are all-reduced per token.
template <typename T>
double vocab_parallel_loss(const ParamLayout& lay, T* logits, const int32_t* targets, int32_t* saved_targets,
                           T* losses, int N, tp::Region& tp);
// probs (N, local_vocab) become dlogits = (p - onehot(target)) * loss_scale, in place.
template <typename T>
void vocab_parallel_loss_backward(const ParamLayout& lay, T* probs, const int32_t* targets, T loss_scale, int N);

// Sequence parallelism's communication (SeqRows), as a family's bodies call it.

// After a row-parallel product into full (N x C partial sums): under sequence parallelism the
// reduce-scatter, and the sums of this rank's rows (at full + first x C) are returned; otherwise
// the all-reduce, and full is.
template <typename T>
T* reduce_rows(const SeqRows& r, tp::Region& tp, T* full, size_t C) {
  if (r.split) {
    tp.scatter_sum(full, r.local * C);
    return full + r.first * C;
  }
  if (tp.size() > 1) tp.sum(full, r.N * C);
  return full;
}

// All N rows of a row-wise tensor (N x C) of which this rank holds its own: under sequence
// parallelism copied into full at their place and gathered, and full is returned; otherwise
// local is (it holds them all).
template <typename T>
const T* gather_rows(const SeqRows& r, tp::Region& tp, const T* local, T* full, size_t C) {
  if (!r.split) return local;
  std::memcpy(full + r.first * C, local, sizeof(T) * r.local * C);
  tp.gather(full, r.local * C);
  return full;
}

// A norm's weight gradient (and its bias's, gb not null), each C wide, which fn(dw, db) adds from
// this rank's rows. Under sequence parallelism those are a part of the micro-batch: fn adds into
// zeroed scratch, which is summed over the tensor-parallel group and then added to gw and gb, so
// every tp rank adds the same whole gradient to its replica of the norm (Megatron sums these
// over tp after the step's backward; summing per norm keeps the gradient final where the
// backward calls prefix_done, which gradient sync and ZeRO rely on).
template <typename T, class Fn>
void norm_weight_grads(const SeqRows& r, tp::Region& tp, std::vector<T>& scratch, T* gw, T* gb, size_t C,
                       Fn&& fn) {
  if (!r.split) {
    fn(gw, gb);
    return;
  }
  const size_t n = gb ? 2 * C : C;
  std::fill(scratch.begin(), scratch.begin() + ptrdiff_t(n), T(0));
  fn(scratch.data(), gb ? scratch.data() + C : nullptr);
  tp.sum(scratch.data(), n);
  for (size_t i = 0; i < C; ++i) gw[i] += scratch[i];
  if (gb)
    for (size_t i = 0; i < C; ++i) gb[i] += scratch[C + i];
}

}  // namespace trn::model
