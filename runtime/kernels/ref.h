// Reference kernels: plain loops, templated on the element type so tests can run them in double
// precision (finite-difference gradient checks) and compare the fast float kernels against them.
// The model uses these directly for the element-wise kernels (layernorm, gelu, residual,
// embedding, cross-entropy), where the loop is already the fast version.
//
// Conventions: N = B*T rows; linear weights are [in, out] (y = x W + b); "dX +=" accumulates,
// "dX =" overwrites.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace trn::kernels::ref {

// out is (B,T,C) = wte[tok] + wpe[t]; tok is (B,T)
template <typename T>
void encoder_forward(T* out, const int32_t* tok, const T* wte, const T* wpe, int B, int Tn, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) {
      T* o = out + (size_t(b) * Tn + t) * C;
      const T* we = wte + size_t(tok[b * Tn + t]) * C;
      const T* pe = wpe + size_t(t) * C;
      for (int i = 0; i < C; ++i) o[i] = we[i] + pe[i];
    }
}

// dwte +=, dwpe += from dout (B,T,C)
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tok, int B, int Tn, int C) {
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < Tn; ++t) {
      const T* d = dout + (size_t(b) * Tn + t) * C;
      T* we = dwte + size_t(tok[b * Tn + t]) * C;
      T* pe = dwpe + size_t(t) * C;
      for (int i = 0; i < C; ++i) {
        we[i] += d[i];
        pe[i] += d[i];
      }
    }
}

// out, inp are (N,C); mean, rstd are (N); eps 1e-5
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* bias, int N,
                       int C) {
  for (int n = 0; n < N; ++n) {
    const T* x = inp + size_t(n) * C;
    T m = 0;
    for (int i = 0; i < C; ++i) m += x[i];
    m /= C;
    T v = 0;
    for (int i = 0; i < C; ++i) v += (x[i] - m) * (x[i] - m);
    v /= C;
    const T s = T(1) / std::sqrt(v + T(1e-5));
    T* o = out + size_t(n) * C;
    for (int i = 0; i < C; ++i) o[i] = (x[i] - m) * s * w[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

// dinp +=, dw +=, db +=
template <typename T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                        const T* mean, const T* rstd, int N, int C) {
  for (int n = 0; n < N; ++n) {
    const T* d = dout + size_t(n) * C;
    const T* x = inp + size_t(n) * C;
    T* dx = dinp + size_t(n) * C;
    const T m = mean[n], s = rstd[n];
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int i = 0; i < C; ++i) {
      const T norm = (x[i] - m) * s;
      const T dnorm = w[i] * d[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    for (int i = 0; i < C; ++i) {
      const T norm = (x[i] - m) * s;
      const T dnorm = w[i] * d[i];
      db[i] += d[i];
      dw[i] += norm * d[i];
      dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

// out (N,OC) = inp (N,IC) @ w (IC,OC) + bias (OC, may be null)
template <typename T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int IC, int OC) {
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      T acc = bias ? bias[o] : T(0);
      for (int i = 0; i < IC; ++i) acc += inp[size_t(n) * IC + i] * w[size_t(i) * OC + o];
      out[size_t(n) * OC + o] = acc;
    }
}

// dinp = dout @ w^T; dw += inp^T @ dout; db += sum of dout rows. dinp null: weights only; dw
// null: the input gradient only (db is then skipped too); db may be null.
template <typename T>
void matmul_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, int N, int IC,
                     int OC) {
  if (dinp)
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < IC; ++i) {
      T acc = 0;
      for (int o = 0; o < OC; ++o) acc += dout[size_t(n) * OC + o] * w[size_t(i) * OC + o];
      dinp[size_t(n) * IC + i] = acc;
    }
  if (!dw) return;
  for (int i = 0; i < IC; ++i)
    for (int o = 0; o < OC; ++o) {
      T acc = 0;
      for (int n = 0; n < N; ++n) acc += inp[size_t(n) * IC + i] * dout[size_t(n) * OC + o];
      dw[size_t(i) * OC + o] += acc;
    }
  if (db)
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) db[o] += dout[size_t(n) * OC + o];
}

// qkv (B,T,3C) holds q, k, v; att (B,NH,T,T) gets the causal softmax (zeros above the
// diagonal); out (B,T,C) the heads' outputs side by side.
template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < Tn; ++t) {
        const T* q = qkv + (size_t(b) * Tn + t) * 3 * C + h * hs;
        T* a = att + ((size_t(b) * NH + h) * Tn + t) * Tn;
        T mx = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          const T* k = qkv + (size_t(b) * Tn + u) * 3 * C + C + h * hs;
          T s = 0;
          for (int i = 0; i < hs; ++i) s += q[i] * k[i];
          a[u] = s * scale;
          if (a[u] > mx) mx = a[u];
        }
        T sum = 0;
        for (int u = 0; u <= t; ++u) sum += (a[u] = std::exp(a[u] - mx));
        for (int u = 0; u <= t; ++u) a[u] /= sum;
        for (int u = t + 1; u < Tn; ++u) a[u] = 0;
        T* o = out + (size_t(b) * Tn + t) * C + h * hs;
        for (int i = 0; i < hs; ++i) o[i] = 0;
        for (int u = 0; u <= t; ++u) {
          const T* v = qkv + (size_t(b) * Tn + u) * 3 * C + 2 * C + h * hs;
          for (int i = 0; i < hs; ++i) o[i] += a[u] * v[i];
        }
      }
}

// dqkv = gradient of qkv (overwritten), from dout (B,T,C) and the forward's att.
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tn, int C,
                        int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(T(hs));
  std::memset(dqkv, 0, sizeof(T) * size_t(B) * Tn * 3 * C);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int t = 0; t < Tn; ++t) {
        const T* a = att + ((size_t(b) * NH + h) * Tn + t) * Tn;
        const T* d = dout + (size_t(b) * Tn + t) * C + h * hs;
        const T* q = qkv + (size_t(b) * Tn + t) * 3 * C + h * hs;
        T* dq = dqkv + (size_t(b) * Tn + t) * 3 * C + h * hs;
        T dot = 0;
        for (int u = 0; u <= t; ++u) {
          const T* v = qkv + (size_t(b) * Tn + u) * 3 * C + 2 * C + h * hs;
          T da = 0;
          for (int i = 0; i < hs; ++i) da += d[i] * v[i];
          dot += a[u] * da;
        }
        for (int u = 0; u <= t; ++u) {
          const size_t row = (size_t(b) * Tn + u) * 3 * C;
          const T* k = qkv + row + C + h * hs;
          const T* v = qkv + row + 2 * C + h * hs;
          T* dk = dqkv + row + C + h * hs;
          T* dv = dqkv + row + 2 * C + h * hs;
          T da = 0;
          for (int i = 0; i < hs; ++i) da += d[i] * v[i];
          const T ds = a[u] * (da - dot) * scale;
          for (int i = 0; i < hs; ++i) {
            dv[i] += a[u] * d[i];
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
}

// tanh-approximated GELU, as GPT-2 and torch.nn.functional.gelu(approximate="tanh")
template <typename T>
void gelu_forward(T* out, const T* inp, size_t N) {
  const T k = std::sqrt(T(2) / T(M_PI));
  for (size_t i = 0; i < N; ++i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
  }
}

// dinp = gelu'(inp) * dout
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t N) {
  const T k = std::sqrt(T(2) / T(M_PI));
  for (size_t i = 0; i < N; ++i) {
    const T x = inp[i];
    const T th = std::tanh(k * (x + T(0.044715) * x * x * x));
    const T dudx = k * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] = (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * dudx) * dout[i];
  }
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t N) {
  for (size_t i = 0; i < N; ++i) out[i] = a[i] + b[i];
}

// logits (N,V) = x (N,C) @ wte (V,C)^T: the LM head tied to the token embedding
template <typename T>
void lmhead_forward(T* logits, const T* x, const T* wte, int N, int C, int V) {
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) {
      T acc = 0;
      for (int i = 0; i < C; ++i) acc += x[size_t(n) * C + i] * wte[size_t(v) * C + i];
      logits[size_t(n) * V + v] = acc;
    }
}

// out (N,OC) = inp (N,IC) @ w (OC,IC)^T
template <typename T>
void linear_forward(T* out, const T* inp, const T* w, int N, int IC, int OC) {
  lmhead_forward(out, inp, w, N, IC, OC);
}

// dinp = dout @ w (unless null); dw += dout^T @ inp (unless null)
template <typename T>
void linear_backward(T* dinp, T* dw, const T* dout, const T* inp, const T* w, int N, int IC, int OC) {
  if (dinp)
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < IC; ++i) {
        T acc = 0;
        for (int o = 0; o < OC; ++o) acc += dout[size_t(n) * OC + o] * w[size_t(o) * IC + i];
        dinp[size_t(n) * IC + i] = acc;
      }
  if (dw)
    for (int o = 0; o < OC; ++o)
      for (int i = 0; i < IC; ++i) {
        T acc = 0;
        for (int n = 0; n < N; ++n) acc += dout[size_t(n) * OC + o] * inp[size_t(n) * IC + i];
        dw[size_t(o) * IC + i] += acc;
      }
}

// dx = dlogits @ wte; dwte += dlogits^T @ x
template <typename T>
void lmhead_backward(T* dx, T* dwte, const T* dlogits, const T* x, const T* wte, int N, int C,
                     int V) {
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < C; ++i) {
      T acc = 0;
      for (int v = 0; v < V; ++v) acc += dlogits[size_t(n) * V + v] * wte[size_t(v) * C + i];
      dx[size_t(n) * C + i] = acc;
    }
  for (int v = 0; v < V; ++v)
    for (int i = 0; i < C; ++i) {
      T acc = 0;
      for (int n = 0; n < N; ++n) acc += dlogits[size_t(n) * V + v] * x[size_t(n) * C + i];
      dwte[size_t(v) * C + i] += acc;
    }
}

// Turns logits (N,V) into probabilities in place; losses (N) = -log p[target].
template <typename T>
void crossentropy_forward(T* losses, T* probs, const int32_t* targets, int N, int V) {
  for (int n = 0; n < N; ++n) {
    T* p = probs + size_t(n) * V;
    T mx = p[0];
    for (int v = 1; v < V; ++v) mx = p[v] > mx ? p[v] : mx;
    const T target_logit = p[targets[n]] - mx;
    T sum = 0;
    for (int v = 0; v < V; ++v) sum += (p[v] = std::exp(p[v] - mx));
    const T inv = T(1) / sum;
    for (int v = 0; v < V; ++v) p[v] *= inv;
    losses[n] = std::log(sum) - target_logit;
  }
}

// Turns probabilities (N,V) into dlogits in place: (p - onehot(target)) * scale.
template <typename T>
void crossentropy_backward(T* probs, const int32_t* targets, T scale, int N, int V) {
  for (int n = 0; n < N; ++n) {
    T* p = probs + size_t(n) * V;
    for (int v = 0; v < V; ++v) p[v] *= scale;
    p[targets[n]] -= scale;
  }
}

}  // namespace trn::kernels::ref
