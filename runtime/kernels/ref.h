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
#include <vector>

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

// Causal attention as the blockwise kernels compute it (kernels.h), row by row: grouped-query,
// scale 1/sqrt(hd), query head h reading KV head h / (H/K).
//
// attention_forward_rows: n query rows against keys and values held apart (a KV cache), row i at
// position t0 + i attending to positions [0, t0 + i]. q (n, qs), k and v (t0 + n, ks), out
// (n, os), each row's heads of hd first; lse[h * ls + i] unless lse is null.
template <typename T>
void attention_forward_rows(T* out, int64_t os, T* lse, int64_t ls, const T* q, int64_t qs, const T* kc, const T* vc,
                            int64_t ks, int t0, int n, int H, int K, int hd) {
  const int group = H / K;
  const T scale = T(1) / std::sqrt(T(hd));
  std::vector<T> s(size_t(t0) + n);
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < n; ++i) {
      const int t = t0 + i;
      const T* qi = q + size_t(i) * qs + size_t(h) * hd;
      const size_t kv = size_t(h / group) * hd;
      T mx = -INFINITY;
      for (int u = 0; u <= t; ++u) {
        const T* k = kc + size_t(u) * ks + kv;
        T dot = 0;
        for (int x = 0; x < hd; ++x) dot += qi[x] * k[x];
        s[u] = dot * scale;
        if (s[u] > mx) mx = s[u];
      }
      T sum = 0;
      for (int u = 0; u <= t; ++u) sum += std::exp(s[u] - mx);
      const T l = mx + std::log(sum);
      if (lse) lse[size_t(h) * ls + i] = l;
      T* o = out + size_t(i) * os + size_t(h) * hd;
      for (int x = 0; x < hd; ++x) o[x] = 0;
      for (int u = 0; u <= t; ++u) {
        const T p = std::exp(s[u] - l);
        const T* v = vc + size_t(u) * ks + kv;
        for (int x = 0; x < hd; ++x) o[x] += p * v[x];
      }
    }
}

// attention_forward: each sequence's rows with t0 = 0. qkv (B,T,(H+2K)*hd) rows [q: H heads |
// k: K heads | v: K heads] (K == H: GPT-2's (B,T,3C) rows, hd = C/H). out (B,T,H*hd); lse
// (B,H,T) gets each row's log-sum-exp of its scaled scores, all backward needs besides q, k, v
// and out.
template <typename T>
void attention_forward(T* out, T* lse, const T* qkv, int B, int Tn, int H, int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd;
  for (int b = 0; b < B; ++b) {
    const T* x = qkv + size_t(b) * Tn * R;
    attention_forward_rows(out + size_t(b) * Tn * OC, OC, lse + size_t(b) * H * Tn, int64_t(Tn), x, R,
                           x + size_t(H) * hd, x + size_t(H + K) * hd, R, 0, Tn, H, K, hd);
  }
}

// dqkv (B,T,(H+2K)*hd) overwritten (dk, dv summed over the query heads of their group) from dout
// (B,T,H*hd) and the forward's out and lse: the probabilities come again from q, k and lse, and
// the softmax's row term is D = dout . out (= sum over u of p_u (dout . v_u)).
template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int B, int Tn, int H,
                        int K, int hd) {
  const int R = (H + 2 * K) * hd, OC = H * hd, group = H / K;
  const T scale = T(1) / std::sqrt(T(hd));
  std::memset(dqkv, 0, sizeof(T) * size_t(B) * Tn * R);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < Tn; ++t) {
        const size_t qrow = (size_t(b) * Tn + t) * R + size_t(h) * hd;
        const T* q = qkv + qrow;
        T* dq = dqkv + qrow;
        const T* d = dout + (size_t(b) * Tn + t) * OC + size_t(h) * hd;
        const T* o = out + (size_t(b) * Tn + t) * OC + size_t(h) * hd;
        const T l = lse[(size_t(b) * H + h) * Tn + t];
        T D = 0;
        for (int i = 0; i < hd; ++i) D += d[i] * o[i];
        for (int u = 0; u <= t; ++u) {
          const size_t krow = (size_t(b) * Tn + u) * R + size_t(H + h / group) * hd;
          const size_t vrow = krow + size_t(K) * hd;
          T dot = 0, dp = 0;
          for (int i = 0; i < hd; ++i) {
            dot += q[i] * qkv[krow + i];
            dp += d[i] * qkv[vrow + i];
          }
          const T p = std::exp(dot * scale - l);
          const T ds = p * (dp - D) * scale;
          for (int i = 0; i < hd; ++i) {
            dq[i] += ds * qkv[krow + i];
            dqkv[krow + i] += ds * q[i];
            dqkv[vrow + i] += p * d[i];
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
