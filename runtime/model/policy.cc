// The precision policies (stage.h) and the bf16 weight copy they multiply with.
#include <cstring>
#include <string>

#include "collectives/core/error.h"
#include "runtime/context_parallel/attention.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/llama.h"
#include "runtime/model/ops.h"
#include "runtime/model/stage.h"
#include "runtime/util/thread_pool.h"

namespace trn::model {

// ---- Precision::kBf16 ----

// Allocated by the first refresh: a model that never forwards over the whole buffer (ZeRO-3)
// never holds it.
Bf16Weights::Bf16Weights(const ParamLayout& layout) : lay_(layout) {}

void Bf16Weights::allocate() {
  if (lay_.config().precision != Precision::kBf16) return;
  if (kernels::bf16_path() == kernels::Bf16Path::kEmulated) f_.assign(lay_.total(), 0.0f);
  else h_.assign(lay_.total(), 0);
}

void Bf16Weights::release() {
  // Swapped with empty vectors: `h_ = {}` would keep the capacity.
  AlignedVector<kernels::bf16>().swap(h_);
  AlignedVector<float>().swap(f_);
}


kernels::Bf16Src Bf16Weights::data() const {
  if (!f_.empty()) return kernels::Bf16Src::widened(f_.data());
  if (!h_.empty()) return h_.data();
  return {};
}

void Bf16Weights::refresh(const float* params, ThreadPool* pool) {
  if (h_.empty() && f_.empty()) allocate();
  if (h_.empty() && f_.empty()) return;  // fp32
  // Elementwise, so how the elements are split over threads does not change the copy.
  auto slice = [&](int k, int n) {
    for (const TensorSpec& t : lay_.tensors()) {
      if (!t.matmul) continue;
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
namespace {

// Context-parallel attention: the cp group's, on float stages (Stage<double> checks kernels alone).
template <typename T>
void cp_forward(cp::Group* group, T* out, T* lse, const T* qkv, int B, int Tn, int H, int K, int hd) {
  if constexpr (std::is_same_v<T, float>)
    cp::attention_forward(*group, out, lse, qkv, B, Tn, H, K, hd);
  else
    throw internal_error("context parallelism runs on float stages only");
}
template <typename T>
void cp_backward(cp::Group* group, T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int Tn,
                 int H, int K, int hd) {
  if constexpr (std::is_same_v<T, float>)
    cp::attention_backward(*group, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
  else
    throw internal_error("context parallelism runs on float stages only");
}

// A bf16 operand of n floats as fp32: its widened form, or widened into the group's buffer i.
const float* widened(cp::Group& group, kernels::Bf16Src x, size_t n, int i) {
  if (x.f) return x.f;
  float* b = group.buffer(i, n);
  kernels::widen_bf16(b, x.h, n);
  return b;
}

}  // namespace

template <typename T>
void FullPrecision<T>::linear_forward(T* out, Operand x, Operand w, int N, int IC, int OC) const {
  ops::linear_forward(out, x, w, N, IC, OC);
}
template <typename T>
void FullPrecision<T>::linear_backward(T* dx, T* dw, OutGrad<T> d, Operand x, Operand w, int N, int IC,
                                       int OC) const {
  ops::linear_backward(dx, dw, d.d, x, w, N, IC, OC);
}
template <typename T>
void FullPrecision<T>::attention_forward(T* out, T* lse, Operand qkv, int B, int Tn, int H, int K, int hd,
                                         AttentionProducts) const {
  if (cp_) return cp_forward(cp_, out, lse, qkv, B, Tn, H, K, hd);
  ops::attention_forward(out, lse, qkv, B, Tn, H, K, hd);
}
template <typename T>
void FullPrecision<T>::attention_backward(T* dqkv, const T* dout, Operand qkv, Operand out, const T* lse, int B,
                                          int Tn, int H, int K, int hd, AttentionProducts) const {
  if (cp_) return cp_backward(cp_, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
  ops::attention_backward(dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
}
template class FullPrecision<float>;
template class FullPrecision<double>;

kernels::Bf16Src Bf16Compute::keep(SavedInput<float>& x, float* v, size_t n) const {
  // oneDNN reads the bf16 form, so v is left as computed; the emulated path also reads v rounded.
  // With nothing to keep (x.half empty), v is rounded in place and is the operand.
  if (x.half.empty()) {
    kernels::round_through_bf16(v, nullptr, n);
    return kernels::Bf16Src::widened(v);
  }
  if (!kernels::bf16_prefers_widened()) {
    kernels::round_to_bf16(x.half.data(), v, n);
    return x.half.data();
  }
  kernels::round_through_bf16(v, x.half.data(), n);
  return kernels::Bf16Src::both(x.half.data(), v);
}
void Bf16Compute::matmul_forward(float* out, Operand x, Operand w, const float* bias, int N, int IC, int OC) const {
  kernels::matmul_forward_bf16(out, x, w, bias, N, IC, OC);
}
void Bf16Compute::matmul_backward(float* dx, float* dw, float* db, OutGrad<float> d, Operand x, Operand w, int N,
                                  int IC, int OC) const {
  // The rounded gradient in the form the GEMM path reads without conversion.
  if (d.into && kernels::bf16_prefers_widened()) kernels::matmul_backward_bf16(dx, dw, db, d.d, d.into, x, w, N, IC, OC);
  else kernels::matmul_backward_bf16(dx, dw, db, d.d, s_.half.data(), x, w, N, IC, OC);
}
void Bf16Compute::lmhead_forward(float* logits, Operand x, Operand wte, int N, int C, int V) const {
  kernels::lmhead_forward_bf16(logits, x, wte, N, C, V);
}
void Bf16Compute::lmhead_backward(float* dx, float* dwte, OutGrad<float> dlogits, Operand x, Operand wte, int N,
                                  int C, int V) const {
  if (dlogits.into && dlogits.into == dlogits.d && kernels::bf16_prefers_widened())
    kernels::lmhead_backward_bf16(dx, dwte, dlogits.into, x, wte, N, C, V);
  else
    kernels::lmhead_backward_bf16(dx, dwte, dlogits.d, s_.half.data(), x, wte, N, C, V);
}
void Bf16Compute::linear_forward(float* out, Operand x, Operand w, int N, int IC, int OC) const {
  kernels::gemm_bf16(false, true, N, OC, IC, x, IC, w, IC, 0.0f, out, OC);
}

void Bf16Compute::linear_backward(float* dx, float* dw, OutGrad<float> d, Operand x, Operand w, int N, int IC,
                                  int OC) const {
  const size_t n = size_t(N) * OC;
  Operand dr;
  if (d.into && kernels::bf16_prefers_widened()) {
    if (d.into != d.d) std::memcpy(d.into, d.d, sizeof(float) * n);
    kernels::round_through_bf16(d.into, nullptr, n);
    dr = Operand::widened(d.into);
  } else {
    kernels::round_to_bf16(s_.half.data(), d.d, n);
    dr = s_.half.data();
  }
  if (dx) kernels::gemm_bf16(false, false, N, IC, OC, dr, OC, w, IC, 0.0f, dx, IC);
  if (dw) kernels::gemm_bf16(true, false, OC, IC, N, dr, OC, x, IC, 1.0f, dw, IC);
}

void Bf16Compute::attention_forward(float* out, float* lse, Operand qkv, int B, int Tn, int H, int K, int hd,
                                    AttentionProducts products) const {
  const size_t seq = size_t(Tn) * (H + 2 * K) * hd;
  if (s_.cp)
    return cp::attention_forward(*s_.cp, out, lse, widened(*s_.cp, qkv, B * seq, cp::kWideQkv), B, Tn, H, K, hd);
  if (products == AttentionProducts::kBf16)
    return kernels::attention_forward_bf16(out, lse, qkv, s_.qkv32.data(), B, Tn, H, K, hd);
  for (int b = 0; b < B; ++b) {
    const float* q = qkv.f ? qkv.f + b * seq : s_.qkv32.data();
    if (!qkv.f) kernels::widen_bf16(s_.qkv32.data(), qkv.h + b * seq, seq);
    kernels::attention_forward(out + size_t(b) * Tn * H * hd, lse + size_t(b) * H * Tn, q, 1, Tn, H, K, hd);
  }
}

void Bf16Compute::attention_backward(float* dqkv, const float* dout, Operand qkv, Operand out, const float* lse,
                                     int B, int Tn, int H, int K, int hd, AttentionProducts products) const {
  TRN_CHECK(qkv.h && out.h);
  // qkv32: one sequence's q, k, v, then (kFp32) its output (Attention::widened_row counts both).
  const size_t seq = size_t(Tn) * (H + 2 * K) * hd, oseq = size_t(Tn) * H * hd;
  if (s_.cp)
    return cp::attention_backward(*s_.cp, dqkv, dout, widened(*s_.cp, qkv, B * seq, cp::kWideQkv),
                                  widened(*s_.cp, out, B * oseq, cp::kWideOut), lse, B, Tn, H, K, hd);
  if (products == AttentionProducts::kBf16)
    return kernels::attention_backward_bf16(dqkv, dout, qkv, s_.qkv32.data(), out, lse, B, Tn, H, K, hd);
  float* q = s_.qkv32.data();
  float* o = q + seq;
  for (int b = 0; b < B; ++b) {
    kernels::widen_bf16(q, qkv.h + b * seq, seq);
    kernels::widen_bf16(o, out.h + b * oseq, oseq);
    kernels::attention_backward(dqkv + b * seq, dout + b * oseq, q, o, lse + size_t(b) * H * Tn, 1, Tn, H, K, hd);
  }
}

}  // namespace trn::model
