#include "runtime/model/layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/model/ops.h"

namespace trn::model {

template <typename T>
void embed_tokens(const ParamLayout& lay, const WeightView<T>& w, const int32_t* tok, T* out, size_t N,
                  tp::Region& tp) {
  const int C = lay.config().d_model;
  const int64_t v0 = lay.vocab_begin(), vn = lay.local_vocab();
  const T* table = w.f32(lay.embedding, size_t(vn) * C);
  for (size_t i = 0; i < N; ++i) {
    T* o = out + i * C;
    const int64_t row = int64_t(tok[i]) - v0;
    if (row >= 0 && row < vn) std::memcpy(o, table + size_t(row) * C, sizeof(T) * C);
    else std::fill(o, o + C, T(0));
  }
  reduce_rows(SeqRows(lay, N), tp, out, size_t(C));  // one rank holds each token's row: the sum adds zeros only
}

template <typename T>
void embed_tokens_backward(const ParamLayout& lay, const GradView<T>& g, const T* dout, const int32_t* tok,
                           size_t N) {
  const int C = lay.config().d_model;
  const int64_t v0 = lay.vocab_begin(), vn = lay.local_vocab();
  T* dtable = g.at(lay.embedding, size_t(vn) * C);
  for (size_t i = 0; i < N; ++i) {
    const int64_t row = int64_t(tok[i]) - v0;
    if (row < 0 || row >= vn) continue;
    const T* d = dout + i * C;
    T* we = dtable + size_t(row) * C;
    for (int k = 0; k < C; ++k) we[k] += d[k];
  }
}

template <typename T>
double vocab_parallel_loss(const ParamLayout& lay, T* logits, const int32_t* targets, int32_t* saved_targets,
                           T* losses, int N, tp::Region& tp) {
  const int64_t V = lay.config().vocab, v0 = lay.vocab_begin();
  const int Vl = static_cast<int>(lay.local_vocab());
  const int valid = static_cast<int>(std::clamp<int64_t>(V - v0, 0, Vl));  // columns past V: padding
  std::memcpy(saved_targets, targets, sizeof(int32_t) * N);
  if (tp.size() == 1 && valid == Vl) {
    ops::crossentropy_forward(losses, logits, saved_targets, N, Vl);
  } else {
    // The row maximum, then the sums of exponentials and the target's logit, each all-reduced
    // over the shards; the logits stay where they are.
    std::vector<T> mx(N), sums(2 * size_t(N), T(0));
    for (int n = 0; n < N; ++n) {
      const T* row = logits + size_t(n) * Vl;
      T m = -std::numeric_limits<T>::infinity();
      for (int v = 0; v < valid; ++v) m = row[v] > m ? row[v] : m;
      mx[n] = m;
    }
    tp.max(mx.data(), N);
    for (int n = 0; n < N; ++n) {
      T* row = logits + size_t(n) * Vl;
      const int64_t t = int64_t(saved_targets[n]) - v0;
      if (t >= 0 && t < valid) sums[N + n] = row[t] - mx[n];
      T sum = 0;
      for (int v = 0; v < valid; ++v) sum += (row[v] = ops::exp_of(row[v] - mx[n]));
      for (int v = valid; v < Vl; ++v) row[v] = T(0);
      sums[n] = sum;
    }
    tp.sum(sums.data(), sums.size());
    for (int n = 0; n < N; ++n) {
      T* row = logits + size_t(n) * Vl;
      const T inv = T(1) / sums[n];
      for (int v = 0; v < valid; ++v) row[v] *= inv;
      losses[n] = std::log(sums[n]) - sums[N + n];
    }
  }
  double sum = 0.0;
  for (int n = 0; n < N; ++n) sum += losses[n];
  return sum;
}

template <typename T>
void vocab_parallel_loss_backward(const ParamLayout& lay, T* probs, const int32_t* targets, T loss_scale, int N) {
  const int64_t v0 = lay.vocab_begin();
  const int Vl = static_cast<int>(lay.local_vocab());
  for (int n = 0; n < N; ++n) {
    T* row = probs + size_t(n) * Vl;
    for (int v = 0; v < Vl; ++v) row[v] *= loss_scale;
    const int64_t t = int64_t(targets[n]) - v0;
    if (t >= 0 && t < Vl) row[t] -= loss_scale;
  }
}

#define TRN_LAYERS(T)                                                                                      \
  template void embed_tokens<T>(const ParamLayout&, const WeightView<T>&, const int32_t*, T*, size_t,      \
                                tp::Region&);                                                              \
  template void embed_tokens_backward<T>(const ParamLayout&, const GradView<T>&, const T*, const int32_t*, \
                                         size_t);                                                          \
  template double vocab_parallel_loss<T>(const ParamLayout&, T*, const int32_t*, int32_t*, T*, int,        \
                                         tp::Region&);                                                     \
  template void vocab_parallel_loss_backward<T>(const ParamLayout&, T*, const int32_t*, T, int);
TRN_LAYERS(float)
TRN_LAYERS(double)
#undef TRN_LAYERS

}  // namespace trn::model
