#include "runtime/kernels/kernels.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "runtime/kernels/bf16.h"
#include "runtime/kernels/fastmath.h"

namespace trn::kernels {

namespace {

bool cpu_has_avx512f() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// oneDNN on AVX-512 CPUs where it dispatches its brgemm fp32 kernel; decided once per process.
const std::string& onednn_f32_here() {
  static const std::string impl = cpu_has_avx512f() ? onednn_f32_impl() : std::string();
  return impl;
}

// C = beta C + op(A) op(B) (+ bias row, then beta must be 0), row-major.
void sgemm(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta,
           float* C, int ldc, const float* bias = nullptr) {
  if (M >= kOneDnnMinRows && K > 0 && fp32_matmuls_onednn())
    return gemm_f32_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc, bias);
  if (bias) {
    for (int m = 0; m < M; ++m) std::memcpy(C + size_t(m) * ldc, bias, sizeof(float) * N);
    beta = 1.0f;
  }
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A, lda, B,
              ldb, beta, C, ldc);
}

}  // namespace

namespace {
std::atomic<int> g_gemm_threads{1};
}  // namespace

void set_gemm_threads(int n) {
  n = std::max(1, n);
  g_gemm_threads.store(n);
  openblas_set_num_threads(n);
}

int gemm_threads() { return g_gemm_threads.load(); }

bool fp32_matmuls_onednn() {
  const std::string& impl = onednn_f32_here();
  return impl.rfind("brg:avx512_core", 0) == 0;
}

std::string fp32_matmul_description() {
  if (fp32_matmuls_onednn()) return "oneDNN " + onednn_version() + " (" + onednn_f32_here() + ")";
  return "OpenBLAS cblas_sgemm";
}

void matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int IC, int OC) {
  sgemm(false, false, N, OC, IC, inp, IC, w, OC, 0.0f, out, OC, bias);
}

void matmul_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w, int N,
                     int IC, int OC) {
  if (dinp) sgemm(false, true, N, IC, OC, dout, OC, w, OC, 0.0f, dinp, IC);
  if (!dw) return;
  sgemm(true, false, IC, OC, N, inp, IC, dout, OC, 1.0f, dw, OC);
  if (db)
    for (int n = 0; n < N; ++n) {
      const float* d = dout + size_t(n) * OC;
      for (int o = 0; o < OC; ++o) db[o] += d[o];
    }
}

void linear_forward(float* out, const float* inp, const float* w, int N, int IC, int OC) {
  sgemm(false, true, N, OC, IC, inp, IC, w, IC, 0.0f, out, OC);
}

void linear_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int N, int IC,
                     int OC) {
  if (dinp) sgemm(false, false, N, IC, OC, dout, OC, w, IC, 0.0f, dinp, IC);
  if (dw) sgemm(true, false, OC, IC, N, dout, OC, inp, IC, 1.0f, dw, IC);
}

void lmhead_forward(float* logits, const float* x, const float* wte, int N, int C, int V) {
  sgemm(false, true, N, V, C, x, C, wte, C, 0.0f, logits, V);
}

void lmhead_backward(float* dx, float* dwte, const float* dlogits, const float* x, const float* wte, int N, int C,
                     int V) {
  sgemm(false, false, N, C, V, dlogits, V, wte, C, 0.0f, dx, C);
  sgemm(true, false, V, C, N, dlogits, V, x, C, 1.0f, dwte, C);
}

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2/pi)
}

void gelu_forward(float* out, const float* inp, size_t N) {
  for (size_t i = 0; i < N; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + fast_tanh(kGeluK * (x + 0.044715f * x * x * x)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N) {
  for (size_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float th = fast_tanh(kGeluK * (x + 0.044715f * x * x * x));
    const float dudx = kGeluK * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * dudx) * dout[i];
  }
}

void crossentropy_forward(float* losses, float* probs, const int32_t* targets, int N, int V) {
  for (int n = 0; n < N; ++n) {
    float* p = probs + size_t(n) * V;
    float mx = p[0];
    for (int v = 1; v < V; ++v) mx = p[v] > mx ? p[v] : mx;
    const float target_logit = p[targets[n]] - mx;
    for (int v = 0; v < V; ++v) p[v] = fast_exp(p[v] - mx);
    float sum = 0.0f;
    for (int v = 0; v < V; ++v) sum += p[v];
    const float inv = 1.0f / sum;
    for (int v = 0; v < V; ++v) p[v] *= inv;
    losses[n] = std::log(sum) - target_logit;
  }
}

}  // namespace trn::kernels
