#include "runtime/model/stage.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"
#include "runtime/util/thread_pool.h"

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

// ---- Precision::kBf16 ----

Bf16Weights::Bf16Weights(const ParamLayout& layout) : lay_(layout) {
  if (layout.config().precision != Precision::kBf16) return;
  if (kernels::bf16_path() == kernels::Bf16Path::kEmulated) f_.assign(layout.total(), 0.0f);
  else h_.assign(layout.total(), 0);
}

namespace {
bool bf16_matmul_weight(const std::string& n) {
  auto ends = [&](const char* suffix) {
    const size_t k = std::strlen(suffix);
    return n.size() >= k && n.compare(n.size() - k, k, suffix) == 0;
  };
  return n == "wte.weight" || ends("attn.c_attn.weight") || ends("attn.c_proj.weight") || ends("mlp.c_fc.weight") ||
         ends("mlp.c_proj.weight");
}
}  // namespace

kernels::Bf16Src Bf16Weights::data() const {
  if (!f_.empty()) return kernels::Bf16Src::widened(f_.data());
  if (!h_.empty()) return h_.data();
  return {};
}

void Bf16Weights::refresh(const float* params, ThreadPool* pool) {
  if (h_.empty() && f_.empty()) return;
  // Elementwise, so how the elements are split over threads does not change the copy.
  auto slice = [&](int k, int n) {
    for (const TensorSpec& t : lay_.tensors()) {
      if (!bf16_matmul_weight(t.name)) continue;
      const size_t b = t.offset + t.numel * k / n, e = t.offset + t.numel * (k + 1) / n;
      if (!f_.empty()) {
        std::memcpy(f_.data() + b, params + b, sizeof(float) * (e - b));
        kernels::round_through_bf16(f_.data() + b, nullptr, e - b);
      } else {
        kernels::round_to_bf16(h_.data() + b, params + b, e - b);
      }
    }
  };
  if (pool && pool->size() > 1) pool->run([&](int k) { slice(k, pool->size()); });
  else slice(0, 1);
}

namespace bf16path {

using kernels::bf16;

// A row-parallel linear layer with bf16 operands (ops::row_parallel_forward's twin).
void row_parallel_forward(float* out, kernels::Bf16Src inp, kernels::Bf16Src w, const float* bias, int N, int IC,
                          int OC, tp::Region& tp) {
  if (tp.size() == 1) {
    kernels::matmul_forward_bf16(out, inp, w, bias, N, IC, OC);
    return;
  }
  kernels::matmul_forward_bf16(out, inp, w, nullptr, N, IC, OC);
  tp.sum(out, size_t(N) * OC);
  ops::add_bias(out, bias, N, OC);
}

// Block<float>::forward under kBf16: each matmul input is computed in fp32 into scratch, rounded
// there through bf16 in the pass that stores its bf16 copy, and multiplied from the scratch (the
// fp32 form of the same operand, so nothing is widened in forward).
void block_forward(const ParamLayout& lay, int layer, const float* p, kernels::Bf16Src pw, const float* in,
                   BlockActivations<float>& a, BackwardScratch<float>& s, int B, int Tn, tp::Region& tp) {
  using kernels::Bf16Src;
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  float* t1 = s.dtmp.data();  // N*C
  float* t2 = s.dbig.data();  // N*max(Cm, 3Ca)
  kernels::ref::layernorm_forward(t1, a.ln1_mean.data(), a.ln1_rstd.data(), in, p + o.ln1_w, p + o.ln1_b, N, C);
  kernels::round_through_bf16(t1, a.ln1_h.data(), NC);
  kernels::matmul_forward_bf16(t2, Bf16Src::widened(t1), pw + o.attn_w, p + o.attn_b, N, C, 3 * Ca);
  kernels::round_through_bf16(t2, a.qkv_h.data(), size_t(N) * 3 * Ca);
  kernels::attention_forward_widened(t1, a.att.data(), t2, B, Tn, Ca, NH);
  kernels::round_through_bf16(t1, a.atty_h.data(), size_t(N) * Ca);
  row_parallel_forward(a.res2.data(), Bf16Src::widened(t1), pw + o.attnproj_w, p + o.attnproj_b, N, Ca, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res2[i] += in[i];
  kernels::ref::layernorm_forward(t1, a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p + o.ln2_w,
                                  p + o.ln2_b, N, C);
  kernels::round_through_bf16(t1, a.ln2_h.data(), NC);
  kernels::matmul_forward_bf16(a.fch.data(), Bf16Src::widened(t1), pw + o.fc_w, p + o.fc_b, N, C, Cm);
  kernels::gelu_forward(t2, a.fch.data(), size_t(N) * Cm);
  kernels::round_through_bf16(t2, a.fch_gelu_h.data(), size_t(N) * Cm);
  row_parallel_forward(a.res3.data(), Bf16Src::widened(t2), pw + o.fcproj_w, p + o.fcproj_b, N, Cm, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res3[i] += a.res2[i];
}

// Block<float>::backward under kBf16: the same steps, each matmul through its bf16 twin. Each
// output gradient is rounded through bf16 in fp32 (the operand's fp32 form, read by sgemm with no
// widening): in place where the fp32 gradient is spent after its matmul (c_fc's and c_attn's, in
// dbig), else into a free fp32 scratch (the residual gradient dres stays unrounded: dtmp for
// mlp.c_proj, dbig for attn.c_proj when it is large enough, else the bf16 scratch half).
void block_backward(const ParamLayout& lay, int layer, const float* p, kernels::Bf16Src pw, float* g, const float* in,
                    BlockActivations<float>& a, float* dres, BackwardScratch<float>& s, int B, int Tn,
                    tp::Region& tp, const std::function<void(size_t)>& done, BackwardPart part) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  float* dtmp = s.dtmp.data();
  float* dbig = s.dbig.data();
  const bool full = part == BackwardPart::kFull;
  auto done_if_full = [&](size_t end) {
    if (full) done(end);
  };
  auto keep = [&](std::vector<float>& to, const float* from, size_t n) {
    if (!full) to.assign(from, from + n);
  };
  keep(a.d_fcproj, dres, NC);
  // dtmp is free until c_fc's input gradient: it takes the rounded dres.
  kernels::matmul_backward_bf16(dbig, full ? g + o.fcproj_w : nullptr, g + o.fcproj_b, dres, dtmp,
                                a.fch_gelu_h.data(), pw + o.fcproj_w, N, Cm, C);
  done_if_full(o.fc_w);
  kernels::gelu_backward(dbig, a.fch.data(), dbig, size_t(N) * Cm);
  keep(a.d_fc, dbig, size_t(N) * Cm);
  kernels::matmul_backward_bf16(dtmp, full ? g + o.fc_w : nullptr, g + o.fc_b, dbig, dbig, a.ln2_h.data(), pw + o.fc_w,
                                N, C, Cm);
  tp.sum(dtmp, NC);
  done_if_full(o.ln2_w);
  kernels::ref::layernorm_backward(dres, g + o.ln2_w, g + o.ln2_b, dtmp, a.res2.data(), p + o.ln2_w,
                                   a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  done_if_full(o.attnproj_w);
  keep(a.d_attnproj, dres, NC);
  if (s.dbig.size() >= NC)  // dbig is spent (c_fc's gradient) and free until attention's
    kernels::matmul_backward_bf16(dtmp, full ? g + o.attnproj_w : nullptr, g + o.attnproj_b, dres, dbig,
                                  a.atty_h.data(), pw + o.attnproj_w, N, Ca, C);
  else
    kernels::matmul_backward_bf16(dtmp, full ? g + o.attnproj_w : nullptr, g + o.attnproj_b, dres, s.half.data(),
                                  a.atty_h.data(), pw + o.attnproj_w, N, Ca, C);
  done_if_full(o.attn_w);
  kernels::attention_backward_bf16(dbig, s.datt.data(), s.qkv32.data(), dtmp, a.qkv_h.data(), a.att.data(), B, Tn,
                                   Ca, NH);
  keep(a.d_attn, dbig, size_t(N) * 3 * Ca);
  kernels::matmul_backward_bf16(dtmp, full ? g + o.attn_w : nullptr, g + o.attn_b, dbig, dbig, a.ln1_h.data(),
                                pw + o.attn_w, N, C, 3 * Ca);
  tp.sum(dtmp, NC);
  done_if_full(o.ln1_w);
  kernels::ref::layernorm_backward(dres, g + o.ln1_w, g + o.ln1_b, dtmp, in, p + o.ln1_w, a.ln1_mean.data(),
                                   a.ln1_rstd.data(), N, C);
  done_if_full(o.end);
}

void block_backward_weights(const ParamLayout& lay, int layer, float* g, const BlockActivations<float>& a,
                            BackwardScratch<float>& s, int B, int Tn) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), N = B * Tn;
  bf16* h = s.half.data();
  kernels::matmul_backward_bf16(nullptr, g + o.fcproj_w, g + o.fcproj_b, a.d_fcproj.data(), h, a.fch_gelu_h.data(),
                                nullptr, N, Cm, C);
  kernels::matmul_backward_bf16(nullptr, g + o.fc_w, g + o.fc_b, a.d_fc.data(), h, a.ln2_h.data(), nullptr, N, C, Cm);
  kernels::matmul_backward_bf16(nullptr, g + o.attnproj_w, g + o.attnproj_b, a.d_attnproj.data(), h,
                                a.atty_h.data(), nullptr, N, Ca, C);
  kernels::matmul_backward_bf16(nullptr, g + o.attn_w, g + o.attn_b, a.d_attn.data(), h, a.ln1_h.data(), nullptr, N,
                                C, 3 * Ca);
}

}  // namespace bf16path

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
  const bool bf16 = runs_bf16<T>(lay);
  a.ln1.resize(bf16 ? 0 : N * C);
  a.ln1_mean.resize(N);
  a.ln1_rstd.resize(N);
  a.qkv.resize(bf16 ? 0 : N * 3 * Ca);
  a.att.resize(size_t(B) * NH * Tn * Tn);
  a.atty.resize(bf16 ? 0 : N * Ca);
  a.res2.resize(N * C);
  a.ln2.resize(bf16 ? 0 : N * C);
  a.ln2_mean.resize(N);
  a.ln2_rstd.resize(N);
  a.fch.resize(N * Cm);
  a.fch_gelu.resize(bf16 ? 0 : N * Cm);
  a.res3.resize(N * C);
  if (bf16) {
    a.ln1_h.resize(N * C);
    a.qkv_h.resize(N * 3 * Ca);
    a.atty_h.resize(N * Ca);
    a.ln2_h.resize(N * C);
    a.fch_gelu_h.resize(N * Cm);
  }
}

template <typename T>
void Block<T>::forward(const ParamLayout& lay, int layer, const T* p, kernels::Bf16Src pw, const T* in,
                       BlockActivations<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  if constexpr (std::is_same_v<T, float>) {
    if (pw) return bf16path::block_forward(lay, layer, p, pw, in, a, s, B, Tn, tp);
  }
  (void)s;
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
void Block<T>::backward(const ParamLayout& lay, int layer, const T* p, kernels::Bf16Src pw, T* g, const T* in,
                        BlockActivations<T>& a, T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                        const std::function<void(size_t)>& done, BackwardPart part) {
  if constexpr (std::is_same_v<T, float>) {
    if (pw) return bf16path::block_backward(lay, layer, p, pw, g, in, a, dres, s, B, Tn, tp, done, part);
  }
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
void Block<T>::backward_weights(const ParamLayout& lay, int layer, T* g, const BlockActivations<T>& a,
                                BackwardScratch<T>& s, int B, int Tn) {
  if constexpr (std::is_same_v<T, float>) {
    if (!a.ln1_h.empty()) return bf16path::block_backward_weights(lay, layer, g, a, s, B, Tn);
  }
  (void)s;
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
  if (runs_bf16<T>(lay)) a.lnf_h.resize(N * C);
  else a.lnf.resize(N * C);
  a.lnf_mean.resize(N);
  a.lnf_rstd.resize(N);
  a.probs.resize(N * size_t(lay.local_vocab()));
  a.losses.resize(N);
  a.targets.resize(N);
}

template <typename T>
double Head<T>::forward(const ParamLayout& lay, const T* p, kernels::Bf16Src pw, const T* in,
                        const int32_t* targets, HeadActivations<T>& a, BackwardScratch<T>& s, int B, int Tn,
                        tp::Region& tp) {
  const int C = lay.config().d_model, N = B * Tn;
  const int64_t V = lay.config().vocab, v0 = lay.vocab_begin();
  const int Vl = static_cast<int>(lay.local_vocab());
  const int valid = static_cast<int>(std::clamp<int64_t>(V - v0, 0, Vl));  // columns past V: padding
  T* logits = a.probs.data();
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (pw) {  // kBf16: ln_f in fp32 into scratch, stored as bf16, then the bf16 LM head
      kernels::ref::layernorm_forward(s.dtmp.data(), a.lnf_mean.data(), a.lnf_rstd.data(), in, p + lay.lnf_w,
                                      p + lay.lnf_b, N, C);
      kernels::round_through_bf16(s.dtmp.data(), a.lnf_h.data(), size_t(N) * C);
      kernels::lmhead_forward_bf16(logits, kernels::Bf16Src::widened(s.dtmp.data()), pw + lay.wte, N, C, Vl);
      done = true;
    }
  }
  if (!done) {
    kernels::ref::layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), in, p + lay.lnf_w,
                                    p + lay.lnf_b, N, C);
    ops::lmhead_forward(logits, a.lnf.data(), p + lay.wte, N, C, Vl);
  }
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
void Head<T>::backward(const ParamLayout& lay, const T* p, kernels::Bf16Src pw, T* g, const T* in,
                       HeadActivations<T>& a, T loss_scale, T* dres, BackwardScratch<T>& s, int B, int Tn,
                       tp::Region& tp) {
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
  bool done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (pw) {
      // dlogits are spent after the head's products: rounded through bf16 in place.
      kernels::lmhead_backward_bf16(dtmp, g + lay.wte, dl, a.lnf_h.data(), pw + lay.wte, N, C, Vl);
      done = true;
    }
  }
  if (!done) ops::lmhead_backward(dtmp, g + lay.wte, dl, a.lnf.data(), p + lay.wte, N, C, Vl);
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
  if (runs_bf16<T>(lay_)) {
    const size_t widest = std::max({size_t(lay_.local_mlp()), 3 * size_t(lay_.local_attn()), C,
                                    last() ? size_t(lay_.local_vocab()) : size_t(0)});
    scratch_.half.resize(N * widest);
    scratch_.qkv32.resize(size_t(T_) * 3 * lay_.local_attn());
  }
}

template <typename T>
kernels::Bf16Src Stage<T>::bf16_weights() const {
  if (!runs_bf16<T>(lay_)) return {};
  if (!pw_) throw internal_error("a bf16 stage ran without its bf16 weights (Stage::use_bf16_weights)");
  return pw_;
}

template <typename T>
size_t Stage<T>::activation_bytes() const {
  size_t n = dres_.size() + scratch_.dtmp.size() + scratch_.dbig.size() + scratch_.datt.size() +
             scratch_.qkv32.size();
  size_t halves = scratch_.half.size();  // bf16 values
  for (const Slot& s : slots_) {
    n += s.x.size() + s.inputs.size() / 2;
    for (const auto& b : s.blocks)
      n += b.ln1.size() + b.ln1_mean.size() + b.ln1_rstd.size() + b.qkv.size() + b.att.size() + b.atty.size() +
           b.res2.size() + b.ln2.size() + b.ln2_mean.size() + b.ln2_rstd.size() + b.fch.size() +
           b.fch_gelu.size() + b.res3.size();
    for (const auto& b : s.blocks)
      halves += b.ln1_h.size() + b.qkv_h.size() + b.atty_h.size() + b.ln2_h.size() + b.fch_gelu_h.size();
    halves += s.head.lnf_h.size();
    n += s.head.lnf.size() + s.head.lnf_mean.size() + s.head.lnf_rstd.size() + s.head.probs.size() +
         s.head.losses.size() + s.head.targets.size() / 2;
  }
  return n * sizeof(T) + halves * sizeof(kernels::bf16);
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
  kernels::Bf16Src pw = bf16_weights();
  for (int l = chunk_.first_layer; l < chunk_.end_layer; ++l)
    Block<T>::forward(lay_, l, p, pw, block_input(s, l), s.blocks[l - chunk_.first_layer], scratch_, B_, T_, tp_);
  if (!last()) return 0.0;
  return Head<T>::forward(lay_, p, pw, block_input(s, chunk_.end_layer), targets, s.head, scratch_, B_, T_, tp_);
}

template <typename T>
void Stage<T>::backward(int slot, const T* p, T* g, T loss_scale, const T* dout,
                        const std::function<void(size_t)>& prefix_done, BackwardPart part) {
  Slot& s = slots_[slot];
  const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
  auto done = [&](size_t end) {
    if (prefix_done) prefix_done(end);
  };
  kernels::Bf16Src pw = bf16_weights();
  if (last()) {
    Head<T>::backward(lay_, p, pw, g, block_input(s, chunk_.end_layer), s.head, loss_scale, dres_.data(), scratch_, B_,
                      T_, tp_);
    if (part == BackwardPart::kFull) done(lay_.lnf_b + C);
  } else {
    std::memcpy(dres_.data(), dout, sizeof(T) * N * C);
  }
  for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l)
    Block<T>::backward(lay_, l, p, pw, g, block_input(s, l), s.blocks[l - chunk_.first_layer], dres_.data(), scratch_,
                       B_, T_, tp_, done, part);
  if (first()) Embedding<T>::backward(lay_, g, dres_.data(), s.inputs.data(), B_, T_);
  if (part == BackwardPart::kFull) done(chunk_end_);
}

template <typename T>
void Stage<T>::backward_weights(int slot, T* g) {
  Slot& s = slots_[slot];
  for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l)
    Block<T>::backward_weights(lay_, l, g, s.blocks[l - chunk_.first_layer], scratch_, B_, T_);
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
