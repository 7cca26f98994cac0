#include "runtime/model/stage.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"

namespace trn::model {
namespace ops {

// float: the fast kernels; double: the reference kernels.
inline void matmul_forward(float* o, const float* x, const float* w, const float* b, int N, int I, int O) {
  kernels::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_forward(double* o, const double* x, const double* w, const double* b, int N, int I, int O) {
  kernels::ref::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w, int N,
                            int I, int O) {
  kernels::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void matmul_backward(double* dx, double* dw, double* db, const double* d, const double* x, const double* w,
                            int N, int I, int O) {
  kernels::ref::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void lmhead_forward(float* l, const float* x, const float* w, int N, int C, int V) {
  kernels::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_forward(double* l, const double* x, const double* w, int N, int C, int V) {
  kernels::ref::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_backward(float* dx, float* dw, const float* dl, const float* x, const float* w, int N, int C,
                            int V) {
  kernels::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void lmhead_backward(double* dx, double* dw, const double* dl, const double* x, const double* w, int N,
                            int C, int V) {
  kernels::ref::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void attention_forward(float* o, float* a, const float* qkv, int B, int T, int C, int NH) {
  kernels::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_forward(double* o, double* a, const double* qkv, int B, int T, int C, int NH) {
  kernels::ref::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_backward(float* dqkv, float* s, const float* d, const float* qkv, const float* a, int B, int T,
                               int C, int NH) {
  kernels::attention_backward(dqkv, s, d, qkv, a, B, T, C, NH);
}
inline void attention_backward(double* dqkv, double*, const double* d, const double* qkv, const double* a, int B,
                               int T, int C, int NH) {
  kernels::ref::attention_backward(dqkv, d, qkv, a, B, T, C, NH);
}
inline void gelu_forward(float* o, const float* x, size_t N) { kernels::gelu_forward(o, x, N); }
inline void gelu_forward(double* o, const double* x, size_t N) { kernels::ref::gelu_forward(o, x, N); }
inline void gelu_backward(float* dx, const float* x, const float* d, size_t N) { kernels::gelu_backward(dx, x, d, N); }
inline void gelu_backward(double* dx, const double* x, const double* d, size_t N) {
  kernels::ref::gelu_backward(dx, x, d, N);
}
inline void crossentropy_forward(float* l, float* p, const int32_t* t, int N, int V) {
  kernels::crossentropy_forward(l, p, t, N, V);
}
inline void crossentropy_forward(double* l, double* p, const int32_t* t, int N, int V) {
  kernels::ref::crossentropy_forward(l, p, t, N, V);
}
inline float exp_of(float x) { return kernels::fast_exp(x); }
inline double exp_of(double x) { return std::exp(x); }

// out[i] += bias[i % C] for out (N,C): the bias of a row-parallel layer, added after its
// all-reduce so that it counts once.
template <typename T>
void add_bias(T* out, const T* bias, int N, int C) {
  for (int n = 0; n < N; ++n) {
    T* o = out + size_t(n) * C;
    for (int i = 0; i < C; ++i) o[i] += bias[i];
  }
}

// A row-parallel linear layer: out (N,OC) = all-reduce(inp (N,IC) @ w (IC,OC)) + bias. With one
// rank the bias rides the matmul.
template <typename T>
void row_parallel_forward(T* out, const T* inp, const T* w, const T* bias, int N, int IC, int OC, tp::Region& tp) {
  if (tp.size() == 1) {
    matmul_forward(out, inp, w, bias, N, IC, OC);
    return;
  }
  matmul_forward(out, inp, w, static_cast<const T*>(nullptr), N, IC, OC);
  tp.sum(out, size_t(N) * OC);
  add_bias(out, bias, N, OC);
}

}  // namespace ops

// ---- Embedding ----

template <typename T>
void Embedding<T>::forward(const ParamLayout& lay, const T* p, const int32_t* tok, T* out, int B, int Tn,
                           tp::Region& tp) {
  const int C = lay.config().d_model;
  const int64_t v0 = lay.vocab_begin(), vn = lay.local_vocab();
  const T* wte = p + lay.wte;
  const size_t N = size_t(B) * Tn;
  for (size_t i = 0; i < N; ++i) {
    T* o = out + i * C;
    const int64_t row = int64_t(tok[i]) - v0;
    if (row >= 0 && row < vn) std::memcpy(o, wte + size_t(row) * C, sizeof(T) * C);
    else std::fill(o, o + C, T(0));
  }
  tp.sum(out, N * C);  // exactly one rank holds each token's row: the sum adds zeros only
  const T* wpe = p + lay.wpe;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) {
      T* o = out + (size_t(b) * Tn + t) * C;
      const T* pe = wpe + size_t(t) * C;
      for (int i = 0; i < C; ++i) o[i] += pe[i];
    }
}

template <typename T>
void Embedding<T>::backward(const ParamLayout& lay, T* g, const T* dout, const int32_t* tok, int B, int Tn) {
  const int C = lay.config().d_model;
  const int64_t v0 = lay.vocab_begin(), vn = lay.local_vocab();
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) {
      const size_t i = size_t(b) * Tn + t;
      const T* d = dout + i * C;
      T* pe = g + lay.wpe + size_t(t) * C;
      const int64_t row = int64_t(tok[i]) - v0;
      if (row >= 0 && row < vn) {
        T* we = g + lay.wte + size_t(row) * C;
        for (int k = 0; k < C; ++k) we[k] += d[k];
      }
      for (int k = 0; k < C; ++k) pe[k] += d[k];
    }
}

// ---- Block ----

template <typename T>
void Block<T>::allocate(BlockActivations<T>& a, const ParamLayout& lay, int B, int Tn) {
  const size_t N = size_t(B) * Tn, C = lay.config().d_model;
  const size_t Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  a.ln1.resize(N * C);
  a.ln1_mean.resize(N);
  a.ln1_rstd.resize(N);
  a.qkv.resize(N * 3 * Ca);
  a.att.resize(size_t(B) * NH * Tn * Tn);
  a.atty.resize(N * Ca);
  a.res2.resize(N * C);
  a.ln2.resize(N * C);
  a.ln2_mean.resize(N);
  a.ln2_rstd.resize(N);
  a.fch.resize(N * Cm);
  a.fch_gelu.resize(N * Cm);
  a.res3.resize(N * C);
}

template <typename T>
void Block<T>::forward(const ParamLayout& lay, int layer, const T* p, const T* in, BlockActivations<T>& a, int B,
                       int Tn, tp::Region& tp) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  kernels::ref::layernorm_forward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), in, p + o.ln1_w, p + o.ln1_b,
                                  N, C);
  // Column-parallel: this rank's heads' q, k and v.
  ops::matmul_forward(a.qkv.data(), a.ln1.data(), p + o.attn_w, p + o.attn_b, N, C, 3 * Ca);
  ops::attention_forward(a.atty.data(), a.att.data(), a.qkv.data(), B, Tn, Ca, NH);
  // Row-parallel: partial outputs all-reduced.
  ops::row_parallel_forward(a.res2.data(), a.atty.data(), p + o.attnproj_w, p + o.attnproj_b, N, Ca, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res2[i] += in[i];
  kernels::ref::layernorm_forward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p + o.ln2_w,
                                  p + o.ln2_b, N, C);
  ops::matmul_forward(a.fch.data(), a.ln2.data(), p + o.fc_w, p + o.fc_b, N, C, Cm);  // column-parallel
  ops::gelu_forward(a.fch_gelu.data(), a.fch.data(), size_t(N) * Cm);
  ops::row_parallel_forward(a.res3.data(), a.fch_gelu.data(), p + o.fcproj_w, p + o.fcproj_b, N, Cm, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res3[i] += a.res2[i];
}

template <typename T>
void Block<T>::backward(const ParamLayout& lay, int layer, const T* p, T* g, const T* in, BlockActivations<T>& a,
                        T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                        const std::function<void(size_t)>& done, BackwardPart part) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  T* dtmp = s.dtmp.data();
  T* dbig = s.dbig.data();
  const bool full = part == BackwardPart::kFull;
  // Only a full pass finalises tensors: after an input-only one the weights are still to come.
  auto done_if_full = [&](size_t end) {
    if (full) done(end);
  };
  // An input-only pass keeps each matmul's output gradient for backward_weights.
  auto keep = [&](std::vector<T>& to, const T* from, size_t n) {
    if (!full) to.assign(from, from + n);
  };
  // res3 = res2 + fcproj(gelu(fc(ln2(res2))))
  keep(a.d_fcproj, dres, NC);
  ops::matmul_backward(dbig, full ? g + o.fcproj_w : nullptr, g + o.fcproj_b, dres, a.fch_gelu.data(),
                       p + o.fcproj_w, N, Cm, C);
  done_if_full(o.fc_w);
  ops::gelu_backward(dbig, a.fch.data(), dbig, size_t(N) * Cm);
  keep(a.d_fc, dbig, size_t(N) * Cm);
  ops::matmul_backward(dtmp, full ? g + o.fc_w : nullptr, g + o.fc_b, dbig, a.ln2.data(), p + o.fc_w, N, C, Cm);
  tp.sum(dtmp, NC);  // column-parallel: the input gradient is a sum over the shards
  done_if_full(o.ln2_w);
  kernels::ref::layernorm_backward(dres, g + o.ln2_w, g + o.ln2_b, dtmp, a.res2.data(), p + o.ln2_w,
                                   a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  done_if_full(o.attnproj_w);
  // res2 = in + attnproj(attention(attn(ln1(in))))
  keep(a.d_attnproj, dres, NC);
  ops::matmul_backward(dtmp, full ? g + o.attnproj_w : nullptr, g + o.attnproj_b, dres, a.atty.data(),
                       p + o.attnproj_w, N, Ca, C);
  done_if_full(o.attn_w);
  ops::attention_backward(dbig, s.datt.data(), dtmp, a.qkv.data(), a.att.data(), B, Tn, Ca, NH);
  keep(a.d_attn, dbig, size_t(N) * 3 * Ca);
  ops::matmul_backward(dtmp, full ? g + o.attn_w : nullptr, g + o.attn_b, dbig, a.ln1.data(), p + o.attn_w, N, C,
                       3 * Ca);
  tp.sum(dtmp, NC);
  done_if_full(o.ln1_w);
  kernels::ref::layernorm_backward(dres, g + o.ln1_w, g + o.ln1_b, dtmp, in, p + o.ln1_w, a.ln1_mean.data(),
                                   a.ln1_rstd.data(), N, C);
  done_if_full(o.end);
}

template <typename T>
void Block<T>::backward_weights(const ParamLayout& lay, int layer, T* g, const BlockActivations<T>& a, int B,
                                int Tn) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), N = B * Tn;
  // Weights and biases of the four matmuls, in a full backward's order.
  T* none = nullptr;
  const T* no_w = nullptr;
  ops::matmul_backward(none, g + o.fcproj_w, g + o.fcproj_b, a.d_fcproj.data(), a.fch_gelu.data(), no_w, N, Cm, C);
  ops::matmul_backward(none, g + o.fc_w, g + o.fc_b, a.d_fc.data(), a.ln2.data(), no_w, N, C, Cm);
  ops::matmul_backward(none, g + o.attnproj_w, g + o.attnproj_b, a.d_attnproj.data(), a.atty.data(), no_w, N, Ca, C);
  ops::matmul_backward(none, g + o.attn_w, g + o.attn_b, a.d_attn.data(), a.ln1.data(), no_w, N, C, 3 * Ca);
}

// ---- Head ----

template <typename T>
void Head<T>::allocate(HeadActivations<T>& a, const ParamLayout& lay, int B, int Tn) {
  const size_t N = size_t(B) * Tn, C = lay.config().d_model;
  a.lnf.resize(N * C);
  a.lnf_mean.resize(N);
  a.lnf_rstd.resize(N);
  a.probs.resize(N * size_t(lay.local_vocab()));
  a.losses.resize(N);
  a.targets.resize(N);
}

template <typename T>
double Head<T>::forward(const ParamLayout& lay, const T* p, const T* in, const int32_t* targets,
                        HeadActivations<T>& a, int B, int Tn, tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int64_t V = lay.config().vocab, v0 = lay.vocab_begin();
  const int Vl = static_cast<int>(lay.local_vocab());
  const int valid = static_cast<int>(std::clamp<int64_t>(V - v0, 0, Vl));  // columns past V: padding
  kernels::ref::layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), in, p + lay.lnf_w,
                                  p + lay.lnf_b, N, C);
  T* logits = a.probs.data();
  ops::lmhead_forward(logits, a.lnf.data(), p + lay.wte, N, C, Vl);
  if (!targets) return 0.0;
  std::memcpy(a.targets.data(), targets, sizeof(int32_t) * N);
  if (tp.size() == 1 && valid == Vl) {
    ops::crossentropy_forward(a.losses.data(), logits, a.targets.data(), N, Vl);
  } else {
    // Vocabulary-parallel cross-entropy: the row maximum, then the sums of exponentials and the
    // target's logit, each all-reduced over the shards; the logits stay where they are.
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
      const int64_t t = int64_t(a.targets[n]) - v0;
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
      a.losses[n] = std::log(sums[n]) - sums[N + n];
    }
  }
  double sum = 0.0;
  for (int n = 0; n < N; ++n) sum += a.losses[n];
  return sum;
}

template <typename T>
void Head<T>::backward(const ParamLayout& lay, const T* p, T* g, const T* in, HeadActivations<T>& a, T loss_scale,
                       T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int64_t v0 = lay.vocab_begin();
  const int Vl = static_cast<int>(lay.local_vocab());
  T* dl = a.probs.data();  // probabilities become dlogits = (p - onehot(target)) * scale, in place
  for (int n = 0; n < N; ++n) {
    T* row = dl + size_t(n) * Vl;
    for (int v = 0; v < Vl; ++v) row[v] *= loss_scale;
    const int64_t t = int64_t(a.targets[n]) - v0;
    if (t >= 0 && t < Vl) row[t] -= loss_scale;
  }
  T* dtmp = s.dtmp.data();
  ops::lmhead_backward(dtmp, g + lay.wte, dl, a.lnf.data(), p + lay.wte, N, C, Vl);
  tp.sum(dtmp, size_t(N) * C);  // the head is column-parallel over the vocabulary
  std::fill(dres, dres + size_t(N) * C, T(0));
  kernels::ref::layernorm_backward(dres, g + lay.lnf_w, g + lay.lnf_b, dtmp, in, p + lay.lnf_w, a.lnf_mean.data(),
                                   a.lnf_rstd.data(), N, C);
}

// ---- Stage ----

template <typename T>
Stage<T>::Stage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region* tp, int chunk)
    : lay_(layout), chunk_(layout.chunks().at(chunk)), B_(batch), T_(seq_len), tp_(tp ? *tp : tp::single()) {
  const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
  slots_.resize(std::max(slots, 1));
  for (Slot& s : slots_) {
    if (first()) s.inputs.resize(N);
    s.x.resize(N * C);
    s.blocks.resize(chunk_.end_layer - chunk_.first_layer);
    for (auto& b : s.blocks) Block<T>::allocate(b, lay_, B_, T_);
    if (last()) Head<T>::allocate(s.head, lay_, B_, T_);
  }
  chunk_end_ = lay_.chunk_range(chunk).second;
  dres_.resize(N * C);
  scratch_.dtmp.resize(N * C);
  scratch_.dbig.resize(N * size_t(std::max(lay_.local_mlp(), 3 * lay_.local_attn())));
  scratch_.datt.resize(size_t(T_) * T_);
}

template <typename T>
size_t Stage<T>::activation_bytes() const {
  size_t n = dres_.size() + scratch_.dtmp.size() + scratch_.dbig.size() + scratch_.datt.size();
  for (const Slot& s : slots_) {
    n += s.x.size() + s.inputs.size() / 2;
    for (const auto& b : s.blocks)
      n += b.ln1.size() + b.ln1_mean.size() + b.ln1_rstd.size() + b.qkv.size() + b.att.size() + b.atty.size() +
           b.res2.size() + b.ln2.size() + b.ln2_mean.size() + b.ln2_rstd.size() + b.fch.size() +
           b.fch_gelu.size() + b.res3.size();
    n += s.head.lnf.size() + s.head.lnf_mean.size() + s.head.lnf_rstd.size() + s.head.probs.size() +
         s.head.losses.size() + s.head.targets.size() / 2;
  }
  return n * sizeof(T);
}

template <typename T>
const T* Stage<T>::block_input(const Slot& s, int layer) const {
  return layer == chunk_.first_layer ? s.x.data() : s.blocks[layer - 1 - chunk_.first_layer].res3.data();
}

template <typename T>
const T* Stage<T>::output(int slot) const {
  return block_input(slots_[slot], chunk_.end_layer);
}

template <typename T>
double Stage<T>::forward(int slot, const T* p, const int32_t* inputs, const T* hidden, const int32_t* targets) {
  Slot& s = slots_[slot];
  const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
  if (first()) {
    std::memcpy(s.inputs.data(), inputs, sizeof(int32_t) * N);
    Embedding<T>::forward(lay_, p, s.inputs.data(), s.x.data(), B_, T_, tp_);
  } else {
    std::memcpy(s.x.data(), hidden, sizeof(T) * N * C);
  }
  for (int l = chunk_.first_layer; l < chunk_.end_layer; ++l)
    Block<T>::forward(lay_, l, p, block_input(s, l), s.blocks[l - chunk_.first_layer], B_, T_, tp_);
  if (!last()) return 0.0;
  return Head<T>::forward(lay_, p, block_input(s, chunk_.end_layer), targets, s.head, B_, T_, tp_);
}

template <typename T>
void Stage<T>::backward(int slot, const T* p, T* g, T loss_scale, const T* dout,
                        const std::function<void(size_t)>& prefix_done, BackwardPart part) {
  Slot& s = slots_[slot];
  const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
  auto done = [&](size_t end) {
    if (prefix_done) prefix_done(end);
  };
  if (last()) {
    Head<T>::backward(lay_, p, g, block_input(s, chunk_.end_layer), s.head, loss_scale, dres_.data(), scratch_, B_,
                      T_, tp_);
    if (part == BackwardPart::kFull) done(lay_.lnf_b + C);
  } else {
    std::memcpy(dres_.data(), dout, sizeof(T) * N * C);
  }
  for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l)
    Block<T>::backward(lay_, l, p, g, block_input(s, l), s.blocks[l - chunk_.first_layer], dres_.data(), scratch_,
                       B_, T_, tp_, done, part);
  if (first()) Embedding<T>::backward(lay_, g, dres_.data(), s.inputs.data(), B_, T_);
  if (part == BackwardPart::kFull) done(chunk_end_);
}

template <typename T>
void Stage<T>::backward_weights(int slot, T* g) {
  Slot& s = slots_[slot];
  for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l)
    Block<T>::backward_weights(lay_, l, g, s.blocks[l - chunk_.first_layer], B_, T_);
}

template class Embedding<float>;
template class Embedding<double>;
template class Block<float>;
template class Block<double>;
template class Head<float>;
template class Head<double>;
template class Stage<float>;
template class Stage<double>;

}  // namespace trn::model
