// Reference kernels of a Llama block: plain loops templated on the element type (double for
// finite-difference checks, float to compare with the fast kernels), the same arguments as the
// fast float kernels in llama.h, whose comments give the contracts. Every sum accumulates in T.
// The parameter named T in llama.h (sequence length) is Tn here.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstring>

#include "runtime/kernels/llama.h"

namespace trn::kernels::ref {

// out (N,C) = inp * rstd * weight; rstd (N) = 1 / sqrt(mean(inp^2) + eps)
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int N, int C, float eps) {
  for (int n = 0; n < N; ++n) {
    const T* x = inp + size_t(n) * C;
    T ss = 0;
    for (int i = 0; i < C; ++i) ss += x[i] * x[i];
    const T s = T(1) / std::sqrt(ss / T(C) + T(eps));
    T* o = out + size_t(n) * C;
    for (int i = 0; i < C; ++i) o[i] = x[i] * s * weight[i];
    rstd[n] = s;
  }
}

// dinp +=, dweight +=
template <typename T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                      const T* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const T* d = dout + size_t(n) * C;
    const T* x = inp + size_t(n) * C;
    T* dx = dinp + size_t(n) * C;
    const T s = rstd[n];
    T dnorm_norm_mean = 0;
    for (int i = 0; i < C; ++i) dnorm_norm_mean += weight[i] * d[i] * x[i] * s;
    dnorm_norm_mean /= T(C);
    for (int i = 0; i < C; ++i) {
      const T norm = x[i] * s;
      dweight[i] += norm * d[i];
      dx[i] += (weight[i] * d[i] - norm * dnorm_norm_mean) * s;
    }
  }
}

// cos, sin (seq_len, hd/2) = cos/sin(t * rope_frequency(i)), angles in double
template <typename T>
void rope_table(T* cos, T* sin, int seq_len, int hd, double theta, const RopeScaling& scaling = {}) {
  const int half = hd / 2;
  for (int t = 0; t < seq_len; ++t)
    for (int i = 0; i < half; ++i) {
      const double angle = double(t) * rope_frequency(i, hd, theta, scaling);
      cos[size_t(t) * half + i] = T(std::cos(angle));
      sin[size_t(t) * half + i] = T(std::sin(angle));
    }
}

// Rotates the first n_heads heads of the B*Tn rows of x in place (HF rotate-half). inverse:
// the transpose rotation (the backward).
template <typename T>
void rope_rotate(T* x, int B, int Tn, int row_stride, int n_heads, int hd, const T* cos,
                 const T* sin, bool inverse) {
  const int half = hd / 2;
  for (size_t r = 0; r < size_t(B) * Tn; ++r) {
    const T* c = cos + (r % Tn) * half;
    const T* s = sin + (r % Tn) * half;
    for (int h = 0; h < n_heads; ++h) {
      T* u = x + r * row_stride + size_t(h) * hd;
      for (int i = 0; i < half; ++i) {
        const T a = u[i], b = u[i + half], sn = inverse ? -s[i] : s[i];
        u[i] = a * c[i] - b * sn;
        u[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

template <typename T>
void rope_forward(T* x, int B, int Tn, int row_stride, int n_heads, int hd, const T* cos,
                  const T* sin) {
  rope_rotate(x, B, Tn, row_stride, n_heads, hd, cos, sin, false);
}

template <typename T>
void rope_backward(T* dx, int B, int Tn, int row_stride, int n_heads, int hd, const T* cos,
                   const T* sin) {
  rope_rotate(dx, B, Tn, row_stride, n_heads, hd, cos, sin, true);
}

// out (N,F) = silu(gate) * up, gu (N,2F) rows [gate | up]
template <typename T>
void swiglu_forward(T* out, const T* gu, int N, int F) {
  for (int n = 0; n < N; ++n) {
    const T* g = gu + size_t(n) * 2 * F;
    const T* u = g + F;
    T* o = out + size_t(n) * F;
    for (int i = 0; i < F; ++i) o[i] = g[i] / (T(1) + std::exp(-g[i])) * u[i];
  }
}

// dgu (N,2F) overwritten
template <typename T>
void swiglu_backward(T* dgu, const T* dout, const T* gu, int N, int F) {
  for (int n = 0; n < N; ++n) {
    const T* g = gu + size_t(n) * 2 * F;
    const T* u = g + F;
    const T* d = dout + size_t(n) * F;
    T* dg = dgu + size_t(n) * 2 * F;
    T* du = dg + F;
    for (int i = 0; i < F; ++i) {
      const T sig = T(1) / (T(1) + std::exp(-g[i]));
      du[i] = d[i] * g[i] * sig;
      dg[i] = d[i] * u[i] * sig * (T(1) + g[i] * (T(1) - sig));
    }
  }
}

// qkv (B,Tn,(H+2K)*hd) -> out (B,Tn,H*hd); att (B,H,Tn,Tn) gets the causal softmax (zeros above
// the diagonal). Query head h reads KV head h / (H/K).
template <typename T>
void attention_forward_gqa(T* out, T* att, const T* qkv, int B, int Tn, int H, int K, int hd) {
  const size_t R = size_t(H + 2 * K) * hd, OC = size_t(H) * hd;
  const int group = H / K;
  const T scale = T(1) / std::sqrt(T(hd));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const size_t koff = size_t(H + h / group) * hd, voff = size_t(H + K + h / group) * hd;
      for (int t = 0; t < Tn; ++t) {
        const T* q = qkv + (size_t(b) * Tn + t) * R + size_t(h) * hd;
        T* a = att + ((size_t(b) * H + h) * Tn + t) * Tn;
        T mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          const T* k = qkv + (size_t(b) * Tn + u) * R + koff;
          T s = 0;
          for (int i = 0; i < hd; ++i) s += q[i] * k[i];
          a[u] = s * scale;
          if (a[u] > mx) mx = a[u];
        }
        T sum = 0;
        for (int u = 0; u <= t; ++u) sum += (a[u] = std::exp(a[u] - mx));
        for (int u = 0; u <= t; ++u) a[u] /= sum;
        for (int u = t + 1; u < Tn; ++u) a[u] = 0;
        T* o = out + (size_t(b) * Tn + t) * OC + size_t(h) * hd;
        for (int i = 0; i < hd; ++i) o[i] = 0;
        for (int u = 0; u <= t; ++u) {
          const T* v = qkv + (size_t(b) * Tn + u) * R + voff;
          for (int i = 0; i < hd; ++i) o[i] += a[u] * v[i];
        }
      }
    }
}

// dqkv (B,Tn,(H+2K)*hd) overwritten from dout (B,Tn,H*hd) and the forward's att. The scratch
// argument of the fast kernel is unused here (kept so both have the same arguments).
template <typename T>
void attention_backward_gqa(T* dqkv, T* /*scratch*/, const T* dout, const T* qkv, const T* att,
                            int B, int Tn, int H, int K, int hd) {
  const size_t R = size_t(H + 2 * K) * hd, OC = size_t(H) * hd;
  const int group = H / K;
  const T scale = T(1) / std::sqrt(T(hd));
  std::memset(dqkv, 0, sizeof(T) * size_t(B) * Tn * R);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const size_t qoff = size_t(h) * hd, koff = size_t(H + h / group) * hd,
                   voff = size_t(H + K + h / group) * hd;
      for (int t = 0; t < Tn; ++t) {
        const T* a = att + ((size_t(b) * H + h) * Tn + t) * Tn;
        const T* d = dout + (size_t(b) * Tn + t) * OC + qoff;
        const T* q = qkv + (size_t(b) * Tn + t) * R + qoff;
        T* dq = dqkv + (size_t(b) * Tn + t) * R + qoff;
        T dot = 0;
        for (int u = 0; u <= t; ++u) {
          const T* v = qkv + (size_t(b) * Tn + u) * R + voff;
          T da = 0;
          for (int i = 0; i < hd; ++i) da += d[i] * v[i];
          dot += a[u] * da;
        }
        for (int u = 0; u <= t; ++u) {
          const size_t row = (size_t(b) * Tn + u) * R;
          const T* k = qkv + row + koff;
          const T* v = qkv + row + voff;
          T* dk = dqkv + row + koff;
          T* dv = dqkv + row + voff;
          T da = 0;
          for (int i = 0; i < hd; ++i) da += d[i] * v[i];
          const T ds = a[u] * (da - dot) * scale;
          for (int i = 0; i < hd; ++i) {
            dv[i] += a[u] * d[i];
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
    }
}

}  // namespace trn::kernels::ref
