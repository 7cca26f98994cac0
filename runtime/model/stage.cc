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

// ---- Precision policies ----

template <typename T>
void FullPrecision<T>::matmul_forward(T* out, Operand x, Operand w, const T* bias, int N, int IC, int OC) const {
  ops::matmul_forward(out, x, w, bias, N, IC, OC);
}
template <typename T>
void FullPrecision<T>::matmul_backward(T* dx, T* dw, T* db, OutGrad<T> d, Operand x, Operand w, int N, int IC,
                                       int OC) const {
  ops::matmul_backward(dx, dw, db, d.d, x, w, N, IC, OC);
}
template <typename T>
void FullPrecision<T>::lmhead_forward(T* logits, Operand x, Operand wte, int N, int C, int V) const {
  ops::lmhead_forward(logits, x, wte, N, C, V);
}
template <typename T>
void FullPrecision<T>::lmhead_backward(T* dx, T* dwte, OutGrad<T> dlogits, Operand x, Operand wte, int N, int C,
                                       int V) const {
  ops::lmhead_backward(dx, dwte, dlogits.d, x, wte, N, C, V);
}
template <typename T>
void FullPrecision<T>::attention_forward(T* out, T* att, Operand qkv, int B, int Tn, int C, int NH) const {
  ops::attention_forward(out, att, qkv, B, Tn, C, NH);
}
template <typename T>
void FullPrecision<T>::attention_backward(T* dqkv, T* scratch, const T* dout, Operand qkv, const T* att, int B,
                                          int Tn, int C, int NH) const {
  ops::attention_backward(dqkv, scratch, dout, qkv, att, B, Tn, C, NH);
}
template class FullPrecision<float>;
template class FullPrecision<double>;

kernels::Bf16Src Bf16Compute::keep(SavedInput<float>& x, float* v, size_t n) const {
  kernels::round_through_bf16(v, x.half.data(), n);
  return kernels::Bf16Src::widened(v);
}
void Bf16Compute::matmul_forward(float* out, Operand x, Operand w, const float* bias, int N, int IC, int OC) const {
  kernels::matmul_forward_bf16(out, x, w, bias, N, IC, OC);
}
void Bf16Compute::matmul_backward(float* dx, float* dw, float* db, OutGrad<float> d, Operand x, Operand w, int N,
                                  int IC, int OC) const {
  if (d.into) kernels::matmul_backward_bf16(dx, dw, db, d.d, d.into, x, w, N, IC, OC);
  else kernels::matmul_backward_bf16(dx, dw, db, d.d, s_.half.data(), x, w, N, IC, OC);
}
void Bf16Compute::lmhead_forward(float* logits, Operand x, Operand wte, int N, int C, int V) const {
  kernels::lmhead_forward_bf16(logits, x, wte, N, C, V);
}
void Bf16Compute::lmhead_backward(float* dx, float* dwte, OutGrad<float> dlogits, Operand x, Operand wte, int N,
                                  int C, int V) const {
  if (dlogits.into && dlogits.into == dlogits.d)
    kernels::lmhead_backward_bf16(dx, dwte, dlogits.into, x, wte, N, C, V);
  else
    kernels::lmhead_backward_bf16(dx, dwte, dlogits.d, s_.half.data(), x, wte, N, C, V);
}
void Bf16Compute::attention_forward(float* out, float* att, Operand qkv, int B, int Tn, int C, int NH) const {
  if (qkv.f) kernels::attention_forward_widened(out, att, qkv.f, B, Tn, C, NH);
  else kernels::attention_forward_bf16(out, att, qkv.h, s_.qkv32.data(), B, Tn, C, NH);
}
void Bf16Compute::attention_backward(float* dqkv, float* scratch, const float* dout, Operand qkv, const float* att,
                                     int B, int Tn, int C, int NH) const {
  TRN_CHECK(qkv.h);
  kernels::attention_backward_bf16(dqkv, scratch, s_.qkv32.data(), dout, qkv.h, att, B, Tn, C, NH);
}

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

// ---- The bodies, over a precision policy P ----

namespace {

// A row-parallel linear layer: out (N,OC) = all-reduce(inp (N,IC) @ w (IC,OC)) + bias. With one
// rank the bias rides the matmul.
template <class P, typename T>
void row_parallel_forward(const P& pol, T* out, typename P::Operand inp, typename P::Operand w, const T* bias, int N,
                          int IC, int OC, tp::Region& tp) {
  if (tp.size() == 1) {
    pol.matmul_forward(out, inp, w, bias, N, IC, OC);
    return;
  }
  pol.matmul_forward(out, inp, w, static_cast<const T*>(nullptr), N, IC, OC);
  tp.sum(out, size_t(N) * OC);
  ops::add_bias(out, bias, N, OC);
}

// The buffers of a block (A: BlockActivations<T>, const or not), each given to fn(vector, n).
template <class P, class A, class Fn>
void block_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const size_t N = size_t(B) * Tn, C = lay.config().d_model;
  const size_t Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  P::reserve(a.ln1, N * C, fn);
  fn(a.ln1_mean, N);
  fn(a.ln1_rstd, N);
  P::reserve(a.qkv, N * 3 * Ca, fn);
  fn(a.att, size_t(B) * NH * Tn * Tn);
  P::reserve(a.atty, N * Ca, fn);
  fn(a.res2, N * C);
  P::reserve(a.ln2, N * C, fn);
  fn(a.ln2_mean, N);
  fn(a.ln2_rstd, N);
  fn(a.fch, N * Cm);
  P::reserve(a.fch_gelu, N * Cm, fn);
  fn(a.res3, N * C);
}

template <class P, class A, class Fn>
void head_buffers(A& a, const ParamLayout& lay, int B, int Tn, Fn&& fn) {
  const size_t N = size_t(B) * Tn, C = lay.config().d_model;
  P::reserve(a.lnf, N * C, fn);
  fn(a.lnf_mean, N);
  fn(a.lnf_rstd, N);
  fn(a.probs, N * size_t(lay.local_vocab()));
  fn(a.losses, N);
  fn(a.targets, N);
}

struct Resize {
  template <class V>
  void operator()(V& v, size_t n) const {
    v.resize(n);
  }
};

// Each matmul input is computed where the policy says: in place in its SavedInput, or in the
// scratch given here (dtmp for the C- and Ca-wide ones, dbig for qkv and fch_gelu; each free at
// that point), and multiplied as keep() returns it.
template <class P, typename T>
void block_forward(const P& pol, const ParamLayout& lay, int layer, const T* p, const T* in, BlockActivations<T>& a,
                   BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), NH = lay.local_heads();
  const int N = B * Tn;
  const size_t NC = size_t(N) * C;
  T* x = pol.output(a.ln1, s.dtmp.data());
  kernels::ref::layernorm_forward(x, a.ln1_mean.data(), a.ln1_rstd.data(), in, p + o.ln1_w, p + o.ln1_b, N, C);
  const auto ln1 = pol.keep(a.ln1, x, NC);
  // Column-parallel: this rank's heads' q, k and v.
  x = pol.output(a.qkv, s.dbig.data());
  pol.matmul_forward(x, ln1, pol.weight(o.attn_w), p + o.attn_b, N, C, 3 * Ca);
  const auto qkv = pol.keep(a.qkv, x, size_t(N) * 3 * Ca);
  x = pol.output(a.atty, s.dtmp.data());
  pol.attention_forward(x, a.att.data(), qkv, B, Tn, Ca, NH);
  const auto atty = pol.keep(a.atty, x, size_t(N) * Ca);
  // Row-parallel: partial outputs all-reduced.
  row_parallel_forward(pol, a.res2.data(), atty, pol.weight(o.attnproj_w), p + o.attnproj_b, N, Ca, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res2[i] += in[i];
  x = pol.output(a.ln2, s.dtmp.data());
  kernels::ref::layernorm_forward(x, a.ln2_mean.data(), a.ln2_rstd.data(), a.res2.data(), p + o.ln2_w, p + o.ln2_b,
                                  N, C);
  const auto ln2 = pol.keep(a.ln2, x, NC);
  pol.matmul_forward(a.fch.data(), ln2, pol.weight(o.fc_w), p + o.fc_b, N, C, Cm);  // column-parallel
  x = pol.output(a.fch_gelu, s.dbig.data());
  ops::gelu_forward(x, a.fch.data(), size_t(N) * Cm);
  const auto fch_gelu = pol.keep(a.fch_gelu, x, size_t(N) * Cm);
  row_parallel_forward(pol, a.res3.data(), fch_gelu, pol.weight(o.fcproj_w), p + o.fcproj_b, N, Cm, C, tp);
  for (size_t i = 0; i < NC; ++i) a.res3[i] += a.res2[i];
}

// The order of the done() calls is the contract with gradient sync (prefix_done): one body, so
// every policy keeps it. An output gradient is spent (may be rounded in place) when only its
// matmul reads it afterwards; the residual gradient dres is kept.
template <class P, typename T>
void block_backward(const P& pol, const ParamLayout& lay, int layer, const T* p, T* g, const T* in,
                    BlockActivations<T>& a, T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
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
  // dtmp is free until c_fc's input gradient: it may take the rounded dres.
  pol.matmul_backward(dbig, full ? g + o.fcproj_w : nullptr, g + o.fcproj_b, OutGrad<T>::kept(dres, dtmp),
                      pol.saved(a.fch_gelu), pol.weight(o.fcproj_w), N, Cm, C);
  done_if_full(o.fc_w);
  ops::gelu_backward(dbig, a.fch.data(), dbig, size_t(N) * Cm);
  keep(a.d_fc, dbig, size_t(N) * Cm);
  pol.matmul_backward(dtmp, full ? g + o.fc_w : nullptr, g + o.fc_b, OutGrad<T>::spent(dbig), pol.saved(a.ln2),
                      pol.weight(o.fc_w), N, C, Cm);
  tp.sum(dtmp, NC);  // column-parallel: the input gradient is a sum over the shards
  done_if_full(o.ln2_w);
  kernels::ref::layernorm_backward(dres, g + o.ln2_w, g + o.ln2_b, dtmp, a.res2.data(), p + o.ln2_w,
                                   a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  done_if_full(o.attnproj_w);
  // res2 = in + attnproj(attention(attn(ln1(in))))
  keep(a.d_attnproj, dres, NC);
  // dbig is spent (c_fc's gradient) and free until attention's: it may take the rounded dres
  // when it is wide enough.
  pol.matmul_backward(dtmp, full ? g + o.attnproj_w : nullptr, g + o.attnproj_b,
                      OutGrad<T>::kept(dres, s.dbig.size() >= NC ? dbig : nullptr), pol.saved(a.atty),
                      pol.weight(o.attnproj_w), N, Ca, C);
  done_if_full(o.attn_w);
  pol.attention_backward(dbig, s.datt.data(), dtmp, pol.saved(a.qkv), a.att.data(), B, Tn, Ca, NH);
  keep(a.d_attn, dbig, size_t(N) * 3 * Ca);
  pol.matmul_backward(dtmp, full ? g + o.attn_w : nullptr, g + o.attn_b, OutGrad<T>::spent(dbig), pol.saved(a.ln1),
                      pol.weight(o.attn_w), N, C, 3 * Ca);
  tp.sum(dtmp, NC);
  done_if_full(o.ln1_w);
  kernels::ref::layernorm_backward(dres, g + o.ln1_w, g + o.ln1_b, dtmp, in, p + o.ln1_w, a.ln1_mean.data(),
                                   a.ln1_rstd.data(), N, C);
  done_if_full(o.end);
}

// Weights and biases of the four matmuls, in a full backward's order; the kept gradients are
// read again by nothing else, but const (a policy rounds them into its own scratch).
template <class P, typename T>
void block_backward_weights(const P& pol, const ParamLayout& lay, int layer, T* g, const BlockActivations<T>& a,
                            int B, int Tn) {
  const BlockOffsets& o = lay.blocks[layer];
  const int C = lay.config().d_model, Ca = lay.local_attn(), Cm = lay.local_mlp(), N = B * Tn;
  T* none = nullptr;
  const typename P::Operand no_w{};
  pol.matmul_backward(none, g + o.fcproj_w, g + o.fcproj_b, OutGrad<T>::kept(a.d_fcproj.data()), pol.saved(a.fch_gelu),
                      no_w, N, Cm, C);
  pol.matmul_backward(none, g + o.fc_w, g + o.fc_b, OutGrad<T>::kept(a.d_fc.data()), pol.saved(a.ln2), no_w, N, C,
                      Cm);
  pol.matmul_backward(none, g + o.attnproj_w, g + o.attnproj_b, OutGrad<T>::kept(a.d_attnproj.data()),
                      pol.saved(a.atty), no_w, N, Ca, C);
  pol.matmul_backward(none, g + o.attn_w, g + o.attn_b, OutGrad<T>::kept(a.d_attn.data()), pol.saved(a.ln1), no_w, N,
                      C, 3 * Ca);
}

}  // namespace

// ---- Block ----

template <typename T>
void Block<T>::allocate(BlockActivations<T>& a, const ParamLayout& lay, int B, int Tn) {
  with_policy<T>(lay, [&](auto policy) { block_buffers<typename decltype(policy)::type>(a, lay, B, Tn, Resize{}); });
}

template <typename T>
void Block<T>::forward(const ParamLayout& lay, int layer, const T* p, kernels::Bf16Src pw, const T* in,
                       BlockActivations<T>& a, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp) {
  with_policy<T>(lay, [&](auto policy) {
    const typename decltype(policy)::type pol(p, pw, s);
    block_forward(pol, lay, layer, p, in, a, s, B, Tn, tp);
  });
}

template <typename T>
void Block<T>::backward(const ParamLayout& lay, int layer, const T* p, kernels::Bf16Src pw, T* g, const T* in,
                        BlockActivations<T>& a, T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp,
                        const std::function<void(size_t)>& done, BackwardPart part) {
  with_policy<T>(lay, [&](auto policy) {
    const typename decltype(policy)::type pol(p, pw, s);
    block_backward(pol, lay, layer, p, g, in, a, dres, s, B, Tn, tp, done, part);
  });
}

template <typename T>
void Block<T>::backward_weights(const ParamLayout& lay, int layer, T* g, const BlockActivations<T>& a,
                                BackwardScratch<T>& s, int B, int Tn) {
  with_policy<T>(lay, [&](auto policy) {
    const typename decltype(policy)::type pol(nullptr, {}, s);  // the weight pass reads no weight
    block_backward_weights(pol, lay, layer, g, a, B, Tn);
  });
}

// ---- Head ----

template <typename T>
void Head<T>::allocate(HeadActivations<T>& a, const ParamLayout& lay, int B, int Tn) {
  with_policy<T>(lay, [&](auto policy) { head_buffers<typename decltype(policy)::type>(a, lay, B, Tn, Resize{}); });
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
  with_policy<T>(lay, [&](auto policy) {
    const typename decltype(policy)::type pol(p, pw, s);
    T* x = pol.output(a.lnf, s.dtmp.data());
    kernels::ref::layernorm_forward(x, a.lnf_mean.data(), a.lnf_rstd.data(), in, p + lay.lnf_w, p + lay.lnf_b, N, C);
    pol.lmhead_forward(logits, pol.keep(a.lnf, x, size_t(N) * C), pol.weight(lay.wte), N, C, Vl);
  });
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
  with_policy<T>(lay, [&](auto policy) {
    const typename decltype(policy)::type pol(p, pw, s);
    // dlogits are spent after the head's products.
    pol.lmhead_backward(dtmp, g + lay.wte, OutGrad<T>::spent(dl), pol.saved(a.lnf), pol.weight(lay.wte), N, C, Vl);
  });
  tp.sum(dtmp, size_t(N) * C);  // the head is column-parallel over the vocabulary
  std::fill(dres, dres + size_t(N) * C, T(0));
  kernels::ref::layernorm_backward(dres, g + lay.lnf_w, g + lay.lnf_b, dtmp, in, p + lay.lnf_w, a.lnf_mean.data(),
                                   a.lnf_rstd.data(), N, C);
}

// ---- Stage ----

template <typename T>
template <class Slots, class Vec, class Scratch, class Fn>
void Stage<T>::visit_buffers(const ParamLayout& lay, const Chunk& chunk, int B, int Tn, Slots& slots, Vec& dres,
                             Scratch& scratch, Fn&& fn) {
  const size_t N = size_t(B) * Tn, C = lay.config().d_model;
  const size_t wide = std::max(size_t(lay.local_mlp()), 3 * size_t(lay.local_attn()));
  with_policy<T>(lay, [&](auto policy) {
    using P = typename decltype(policy)::type;
    for (auto& s : slots) {
      if (chunk.embedding) fn(s.inputs, N);
      fn(s.x, N * C);
      for (auto& b : s.blocks) block_buffers<P>(b, lay, B, Tn, fn);
      if (chunk.head) head_buffers<P>(s.head, lay, B, Tn, fn);
    }
    fn(dres, N * C);
    fn(scratch.dtmp, N * C);
    fn(scratch.dbig, N * wide);
    fn(scratch.datt, size_t(Tn) * Tn);
    const size_t widest = std::max({wide, C, chunk.head ? size_t(lay.local_vocab()) : size_t(0)});
    P::reserve_scratch(scratch, N * widest, size_t(Tn) * 3 * lay.local_attn(), fn);
  });
}

template <typename T>
Stage<T>::Stage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region* tp, int chunk)
    : lay_(layout), chunk_(layout.chunks().at(chunk)), B_(batch), T_(seq_len), tp_(tp ? *tp : tp::single()) {
  slots_.resize(std::max(slots, 1));
  for (Slot& s : slots_) s.blocks.resize(chunk_.end_layer - chunk_.first_layer);
  visit_buffers(lay_, chunk_, B_, T_, slots_, dres_, scratch_, Resize{});
  chunk_end_ = lay_.chunk_range(chunk).second;
}

template <typename T>
kernels::Bf16Src Stage<T>::bf16_weights() const {
  if (!runs_bf16<T>(lay_)) return {};
  if (!pw_) throw internal_error("a bf16 stage ran without its bf16 weights (Stage::use_bf16_weights)");
  return pw_;
}

template <typename T>
size_t Stage<T>::activation_bytes() const {
  size_t bytes = 0;
  visit_buffers(lay_, chunk_, B_, T_, slots_, dres_, scratch_, [&](const auto& v, size_t) {
    bytes += v.size() * sizeof(v[0]);  // what is held
  });
  return bytes;
}

template <typename T>
size_t Stage<T>::activation_bytes(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk) {
  const Chunk& c = layout.chunks().at(chunk);
  // Empty stand-ins: nothing is allocated.
  std::vector<Slot> stand_in(std::max(slots, 1));
  for (Slot& s : stand_in) s.blocks.resize(c.end_layer - c.first_layer);
  std::vector<T> dres;
  BackwardScratch<T> scratch;
  size_t bytes = 0;
  visit_buffers(layout, c, batch, seq_len, stand_in, dres, scratch, [&](const auto& v, size_t n) {
    bytes += n * sizeof(v[0]);  // what would be held
  });
  return bytes;
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
