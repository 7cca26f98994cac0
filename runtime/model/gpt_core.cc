#include "runtime/model/gpt_core.h"

#include <cstring>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"

namespace trn::model {
namespace ops {

// float: the fast kernels; double: the reference kernels.
inline void matmul_forward(float* o, const float* x, const float* w, const float* b, int N, int I,
                           int O) {
  kernels::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_forward(double* o, const double* x, const double* w, const double* b, int N,
                           int I, int O) {
  kernels::ref::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_backward(float* dx, float* dw, float* db, const float* d, const float* x,
                            const float* w, int N, int I, int O) {
  kernels::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void matmul_backward(double* dx, double* dw, double* db, const double* d, const double* x,
                            const double* w, int N, int I, int O) {
  kernels::ref::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void lmhead_forward(float* l, const float* x, const float* w, int N, int C, int V) {
  kernels::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_forward(double* l, const double* x, const double* w, int N, int C, int V) {
  kernels::ref::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_backward(float* dx, float* dw, const float* dl, const float* x, const float* w,
                            int N, int C, int V) {
  kernels::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void lmhead_backward(double* dx, double* dw, const double* dl, const double* x,
                            const double* w, int N, int C, int V) {
  kernels::ref::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void attention_forward(float* o, float* a, const float* qkv, int B, int T, int C, int NH) {
  kernels::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_forward(double* o, double* a, const double* qkv, int B, int T, int C,
                              int NH) {
  kernels::ref::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_backward(float* dqkv, float* s, const float* d, const float* qkv,
                               const float* a, int B, int T, int C, int NH) {
  kernels::attention_backward(dqkv, s, d, qkv, a, B, T, C, NH);
}
inline void attention_backward(double* dqkv, double*, const double* d, const double* qkv,
                               const double* a, int B, int T, int C, int NH) {
  kernels::ref::attention_backward(dqkv, d, qkv, a, B, T, C, NH);
}
inline void gelu_forward(float* o, const float* x, size_t N) { kernels::gelu_forward(o, x, N); }
inline void gelu_forward(double* o, const double* x, size_t N) {
  kernels::ref::gelu_forward(o, x, N);
}
inline void gelu_backward(float* dx, const float* x, const float* d, size_t N) {
  kernels::gelu_backward(dx, x, d, N);
}
inline void gelu_backward(double* dx, const double* x, const double* d, size_t N) {
  kernels::ref::gelu_backward(dx, x, d, N);
}
inline void crossentropy_forward(float* l, float* p, const int32_t* t, int N, int V) {
  kernels::crossentropy_forward(l, p, t, N, V);
}
inline void crossentropy_forward(double* l, double* p, const int32_t* t, int N, int V) {
  kernels::ref::crossentropy_forward(l, p, t, N, V);
}

}  // namespace ops

template <typename T>
GptCore<T>::GptCore(const Config& c, const ParamLayout& layout, int batch, int seq_len)
    : c_(c), lay_(layout), B_(batch), T_(seq_len) {
  const size_t N = size_t(B_) * T_, C = c_.d_model;
  inputs_.resize(N);
  targets_.resize(N);
  encoded_.resize(N * C);
  lnf_.resize(N * C);
  lnf_mean_.resize(N);
  lnf_rstd_.resize(N);
  probs_.resize(N * c_.vocab);
  losses_.resize(N);
  layers_.resize(c_.n_layer);
  for (Layer& L : layers_) {
    L.ln1.resize(N * C);
    L.ln1_mean.resize(N);
    L.ln1_rstd.resize(N);
    L.qkv.resize(N * 3 * C);
    L.att.resize(size_t(B_) * c_.n_head * T_ * T_);
    L.atty.resize(N * C);
    L.res2.resize(N * C);
    L.ln2.resize(N * C);
    L.ln2_mean.resize(N);
    L.ln2_rstd.resize(N);
    L.fch.resize(N * 4 * C);
    L.fch_gelu.resize(N * 4 * C);
    L.res3.resize(N * C);
  }
  dres_.resize(N * C);
  dtmp_.resize(N * C);
  dbig_.resize(N * 4 * C);
  datt_.resize(size_t(T_) * T_);
}

template <typename T>
size_t GptCore<T>::activation_bytes() const {
  const size_t N = size_t(B_) * T_, C = c_.d_model;
  const size_t per_layer = N * (17 * C + 4) + size_t(B_) * c_.n_head * T_ * T_;
  return sizeof(T) * (c_.n_layer * per_layer + N * (2 * C + 3 + c_.vocab) + N * 6 * C + T_ * T_);
}

template <typename T>
const T* GptCore<T>::layer_input(int l) const {
  return l == 0 ? encoded_.data() : layers_[l - 1].res3.data();
}

template <typename T>
double GptCore<T>::forward(const T* p, const int32_t* inputs, const int32_t* targets) {
  const int B = B_, Tn = T_, C = c_.d_model, NH = c_.n_head, V = c_.vocab, N = B * Tn;
  const size_t NC = size_t(N) * C;
  std::memcpy(inputs_.data(), inputs, sizeof(int32_t) * N);
  kernels::ref::encoder_forward(encoded_.data(), inputs_.data(), p + lay_.wte, p + lay_.wpe, B, Tn,
                                C);
  for (int l = 0; l < c_.n_layer; ++l) {
    const BlockOffsets& o = lay_.blocks[l];
    Layer& L = layers_[l];
    const T* res = layer_input(l);
    kernels::ref::layernorm_forward(L.ln1.data(), L.ln1_mean.data(), L.ln1_rstd.data(), res,
                                    p + o.ln1_w, p + o.ln1_b, N, C);
    ops::matmul_forward(L.qkv.data(), L.ln1.data(), p + o.attn_w, p + o.attn_b, N, C, 3 * C);
    ops::attention_forward(L.atty.data(), L.att.data(), L.qkv.data(), B, Tn, C, NH);
    ops::matmul_forward(L.res2.data(), L.atty.data(), p + o.attnproj_w, p + o.attnproj_b, N, C, C);
    for (size_t i = 0; i < NC; ++i) L.res2[i] += res[i];
    kernels::ref::layernorm_forward(L.ln2.data(), L.ln2_mean.data(), L.ln2_rstd.data(),
                                    L.res2.data(), p + o.ln2_w, p + o.ln2_b, N, C);
    ops::matmul_forward(L.fch.data(), L.ln2.data(), p + o.fc_w, p + o.fc_b, N, C, 4 * C);
    ops::gelu_forward(L.fch_gelu.data(), L.fch.data(), size_t(N) * 4 * C);
    ops::matmul_forward(L.res3.data(), L.fch_gelu.data(), p + o.fcproj_w, p + o.fcproj_b, N, 4 * C,
                        C);
    for (size_t i = 0; i < NC; ++i) L.res3[i] += L.res2[i];
  }
  kernels::ref::layernorm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(),
                                  layer_input(c_.n_layer), p + lay_.lnf_w, p + lay_.lnf_b, N, C);
  ops::lmhead_forward(probs_.data(), lnf_.data(), p + lay_.wte, N, C, V);
  if (!targets) return 0.0;
  std::memcpy(targets_.data(), targets, sizeof(int32_t) * N);
  ops::crossentropy_forward(losses_.data(), probs_.data(), targets_.data(), N, V);
  double sum = 0.0;
  for (int i = 0; i < N; ++i) sum += losses_[i];
  return sum;
}

template <typename T>
void GptCore<T>::backward(const T* p, T* g, T loss_scale,
                          const std::function<void(size_t)>& prefix_done) {
  const int B = B_, Tn = T_, C = c_.d_model, NH = c_.n_head, V = c_.vocab, N = B * Tn;
  kernels::ref::crossentropy_backward(probs_.data(), targets_.data(), loss_scale, N, V);
  ops::lmhead_backward(dtmp_.data(), g + lay_.wte, probs_.data(), lnf_.data(), p + lay_.wte, N, C,
                       V);
  std::fill(dres_.begin(), dres_.end(), T(0));
  kernels::ref::layernorm_backward(dres_.data(), g + lay_.lnf_w, g + lay_.lnf_b, dtmp_.data(),
                                   layer_input(c_.n_layer), p + lay_.lnf_w, lnf_mean_.data(),
                                   lnf_rstd_.data(), N, C);
  if (prefix_done) prefix_done(lay_.lnf_b + C);
  for (int l = c_.n_layer - 1; l >= 0; --l) {
    const BlockOffsets& o = lay_.blocks[l];
    Layer& L = layers_[l];
    T* dres = dres_.data();
    T* dtmp = dtmp_.data();
    T* dbig = dbig_.data();
    auto done = [&](size_t end) {
      if (prefix_done) prefix_done(end);
    };
    // res3 = res2 + fcproj(gelu(fc(ln2(res2))))
    ops::matmul_backward(dbig, g + o.fcproj_w, g + o.fcproj_b, dres, L.fch_gelu.data(),
                         p + o.fcproj_w, N, 4 * C, C);
    done(o.fc_w);
    ops::gelu_backward(dbig, L.fch.data(), dbig, size_t(N) * 4 * C);
    ops::matmul_backward(dtmp, g + o.fc_w, g + o.fc_b, dbig, L.ln2.data(), p + o.fc_w, N, C, 4 * C);
    done(o.ln2_w);
    kernels::ref::layernorm_backward(dres, g + o.ln2_w, g + o.ln2_b, dtmp, L.res2.data(),
                                     p + o.ln2_w, L.ln2_mean.data(), L.ln2_rstd.data(), N, C);
    done(o.attnproj_w);
    // res2 = res + attnproj(attention(attn(ln1(res))))
    ops::matmul_backward(dtmp, g + o.attnproj_w, g + o.attnproj_b, dres, L.atty.data(),
                         p + o.attnproj_w, N, C, C);
    done(o.attn_w);
    ops::attention_backward(dbig, datt_.data(), dtmp, L.qkv.data(), L.att.data(), B, Tn, C, NH);
    ops::matmul_backward(dtmp, g + o.attn_w, g + o.attn_b, dbig, L.ln1.data(), p + o.attn_w, N, C,
                         3 * C);
    done(o.ln1_w);
    kernels::ref::layernorm_backward(dres, g + o.ln1_w, g + o.ln1_b, dtmp, layer_input(l),
                                     p + o.ln1_w, L.ln1_mean.data(), L.ln1_rstd.data(), N, C);
    done(o.end);
  }
  kernels::ref::encoder_backward(g + lay_.wte, g + lay_.wpe, dres_.data(), inputs_.data(), B, Tn,
                                 C);
  if (prefix_done) prefix_done(lay_.total());
}

template class GptCore<float>;
template class GptCore<double>;

}  // namespace trn::model
