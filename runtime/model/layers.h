// Pieces every family's embedding and head share: the vocabulary-parallel token embedding and
// the vocabulary-parallel cross-entropy (Megatron's split: each tensor-parallel rank holds
// local_vocab() rows of the padded vocabulary; the [B, T, V] logits are never gathered, and
// padding rows never enter the softmax).
#pragma once

#include <cstdint>

#include "runtime/model/config.h"
#include "runtime/model/views.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::model {

// out (N,C) = table[tok] for this rank's rows of the vocabulary (others add 0), summed over the
// tensor-parallel group: exactly one rank holds each token's row. The table is the layout's
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

}  // namespace trn::model
