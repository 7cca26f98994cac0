#include "runtime/kernels/llama.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/llama_ref.h"

namespace trn::kernels {

namespace {

// Reductions over kLanes partial sums (maxima) in a fixed order: without -ffast-math the compiler
// may not reorder a single float accumulator, so one accumulator stays scalar; independent lanes
// vectorize, and the fixed order keeps the result the same on every CPU.
constexpr int kLanes = 16;

inline float sum_lanes(const float* acc) {
  float s = 0.0f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// sum of x[i] over i < n
inline float sum_of(const float* __restrict x, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  for (; i < n; ++i) acc[i % kLanes] += x[i];
  return sum_lanes(acc);
}

// sum of a[i] * b[i] over i < n
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i % kLanes] += a[i] * b[i];
  return sum_lanes(acc);
}

// sum of a[i] * b[i] * c[i] over i < n
inline float dot3(const float* __restrict a, const float* __restrict b, const float* __restrict c,
                  int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  for (; i < n; ++i) acc[i % kLanes] += a[i] * b[i] * c[i];
  return sum_lanes(acc);
}

// max of x[i] over i < n (n >= 1). The lane-wise select is not if-converted from an array of
// partial maxima, so this one is written on a GCC vector type (8 floats: one AVX2 register).
using Lanes8 = float __attribute__((vector_size(8 * sizeof(float))));
inline float max_of(const float* x, int n) {
  Lanes8 acc;
  for (int j = 0; j < 8; ++j) acc[j] = x[0];
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    Lanes8 v;
    std::memcpy(&v, x + i, sizeof v);
    acc = v > acc ? v : acc;
  }
  float m = x[0];
  for (int j = 0; j < 8; ++j) m = acc[j] > m ? acc[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Causal attention works on blocks of kBlock query rows, as kernels::attention_forward: rows
// [r0, r1) only see keys [0, r1), so the upper-right blocks of the T x T scores are never
// computed. Entries of att right of the diagonal inside a computed block are zero; entries right
// of a row block are never written nor read.
constexpr int kBlock = 64;

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  for (int n = 0; n < N; ++n) {
    const float* __restrict x = inp + size_t(n) * C;
    float* __restrict o = out + size_t(n) * C;
    const float s = 1.0f / std::sqrt(dot(x, x, C) / float(C) + eps);
    for (int i = 0; i < C; ++i) o[i] = x[i] * s * weight[i];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const float* __restrict d = dout + size_t(n) * C;
    const float* __restrict x = inp + size_t(n) * C;
    float* __restrict dx = dinp + size_t(n) * C;
    float* __restrict dw = dweight;
    const float s = rstd[n];
    // dx = s * (w*d - norm * mean(w*d*norm)), norm = x*s: the second term is x * (s^2 / C) * sum(w*d*x)
    const float c = dot3(weight, d, x, C) * s * s / float(C);
    for (int i = 0; i < C; ++i) {
      dw[i] += x[i] * s * d[i];
      dx[i] += (weight[i] * d[i] - x[i] * c) * s;
    }
  }
}

void rope_table(float* cos, float* sin, int seq_len, int hd, double theta, const RopeScaling& scaling) {
  ref::rope_table(cos, sin, seq_len, hd, theta, scaling);
}

void rope_forward(float* x, int B, int T, int row_stride, int n_heads, int hd, const float* cos,
                  const float* sin) {
  const int half = hd / 2;
  for (size_t r = 0; r < size_t(B) * T; ++r) {
    const float* __restrict c = cos + (r % T) * half;
    const float* __restrict s = sin + (r % T) * half;
    for (int h = 0; h < n_heads; ++h) {
      float* __restrict lo = x + r * row_stride + size_t(h) * hd;
      float* __restrict hi = lo + half;
      for (int i = 0; i < half; ++i) {
        const float a = lo[i], b = hi[i];
        lo[i] = a * c[i] - b * s[i];
        hi[i] = b * c[i] + a * s[i];
      }
    }
  }
}

void rope_backward(float* dx, int B, int T, int row_stride, int n_heads, int hd, const float* cos,
                   const float* sin) {
  const int half = hd / 2;
  for (size_t r = 0; r < size_t(B) * T; ++r) {
    const float* __restrict c = cos + (r % T) * half;
    const float* __restrict s = sin + (r % T) * half;
    for (int h = 0; h < n_heads; ++h) {
      float* __restrict lo = dx + r * row_stride + size_t(h) * hd;
      float* __restrict hi = lo + half;
      for (int i = 0; i < half; ++i) {
        const float a = lo[i], b = hi[i];
        lo[i] = a * c[i] + b * s[i];
        hi[i] = b * c[i] - a * s[i];
      }
    }
  }
}

void swiglu_forward(float* out, const float* gu, int N, int F) {
  for (int n = 0; n < N; ++n) {
    const float* __restrict g = gu + size_t(n) * 2 * F;
    const float* __restrict u = g + F;
    float* __restrict o = out + size_t(n) * F;
    for (int i = 0; i < F; ++i) o[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
  }
}

void swiglu_backward(float* dgu, const float* dout, const float* gu, int N, int F) {
  for (int n = 0; n < N; ++n) {
    const float* __restrict g = gu + size_t(n) * 2 * F;
    const float* __restrict u = g + F;
    const float* __restrict d = dout + size_t(n) * F;
    float* __restrict dg = dgu + size_t(n) * 2 * F;
    float* __restrict du = dg + F;
    for (int i = 0; i < F; ++i) {
      const float sig = 1.0f / (1.0f + fast_exp(-g[i]));
      du[i] = d[i] * g[i] * sig;
      dg[i] = d[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    }
  }
}

void attention_forward_gqa(float* out, float* att, const float* qkv, int B, int T, int H, int K,
                           int hd) {
  const int R = (H + 2 * K) * hd, OC = H * hd, group = H / K;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const float* rows = qkv + size_t(b) * T * R;
      const float* q = rows + size_t(h) * hd;
      const float* k = rows + size_t(H + h / group) * hd;
      const float* v = rows + size_t(H + K + h / group) * hd;
      float* a = att + (size_t(b) * H + h) * T * T;
      float* o = out + size_t(b) * T * OC + size_t(h) * hd;
      for (int r0 = 0; r0 < T; r0 += kBlock) {
        const int r1 = std::min(T, r0 + kBlock), nr = r1 - r0;
        float* ab = a + size_t(r0) * T;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, r1, hd, scale, q + size_t(r0) * R,
                    R, k, R, 0.0f, ab, T);
        for (int t = r0; t < r1; ++t) {
          float* __restrict row = a + size_t(t) * T;
          const float mx = max_of(row, t + 1);
          for (int u = 0; u <= t; ++u) row[u] = fast_exp(row[u] - mx);
          const float inv = 1.0f / sum_of(row, t + 1);
          for (int u = 0; u <= t; ++u) row[u] *= inv;
          for (int u = t + 1; u < r1; ++u) row[u] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, hd, r1, 1.0f, ab, T, v, R, 0.0f,
                    o + size_t(r0) * OC, OC);
      }
    }
}

void attention_backward_gqa(float* dqkv, float* scratch, const float* dout, const float* qkv,
                            const float* att, int B, int T, int H, int K, int hd) {
  const int R = (H + 2 * K) * hd, OC = H * hd, group = H / K;
  const float scale = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b)
    for (int kv = 0; kv < K; ++kv) {
      const size_t base = size_t(b) * T * R;
      const float* k = qkv + base + size_t(H + kv) * hd;
      const float* v = qkv + base + size_t(H + K + kv) * hd;
      float* dk = dqkv + base + size_t(H + kv) * hd;
      float* dv = dqkv + base + size_t(H + K + kv) * hd;
      // The query heads of this KV head, one after the other: the first overwrites dk and dv,
      // the others add to them, so a KV head is never copied and scratch is one T x T block.
      for (int j = 0; j < group; ++j) {
        const int h = kv * group + j;
        const float* q = qkv + base + size_t(h) * hd;
        float* dq = dqkv + base + size_t(h) * hd;
        const float* d = dout + size_t(b) * T * OC + size_t(h) * hd;
        const float* a = att + (size_t(b) * H + h) * T * T;
        float* ds = scratch;  // the gradient of the scores, (T,T), same blocks as att
        for (int r0 = 0; r0 < T; r0 += kBlock) {
          const int r1 = std::min(T, r0 + kBlock), nr = r1 - r0;
          // gradient of the probabilities: dout @ v^T, then through the softmax
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, r1, hd, 1.0f, d + size_t(r0) * OC,
                      OC, v, R, 0.0f, ds + size_t(r0) * T, T);
          for (int t = r0; t < r1; ++t) {
            const float* __restrict ar = a + size_t(t) * T;
            float* __restrict dr = ds + size_t(t) * T;
            const float dt = dot(ar, dr, t + 1);
            for (int u = 0; u <= t; ++u) dr[u] = ar[u] * (dr[u] - dt) * scale;
            for (int u = t + 1; u < r1; ++u) dr[u] = 0.0f;
          }
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, hd, r1, 1.0f, ds + size_t(r0) * T,
                      T, k, R, 0.0f, dq + size_t(r0) * R, R);
        }
        // keys and values of block [c0, c1) are seen by query rows [c0, T) only
        const float beta = j == 0 ? 0.0f : 1.0f;
        for (int c0 = 0; c0 < T; c0 += kBlock) {
          const int c1 = std::min(T, c0 + kBlock), nc = c1 - c0, nr = T - c0;
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, hd, nr, 1.0f, a + size_t(c0) * T + c0,
                      T, d + size_t(c0) * OC, OC, beta, dv + size_t(c0) * R, R);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nc, hd, nr, 1.0f,
                      ds + size_t(c0) * T + c0, T, q + size_t(c0) * R, R, beta, dk + size_t(c0) * R, R);
        }
      }
    }
}

}  // namespace trn::kernels
