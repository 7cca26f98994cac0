// Causal attention under --precision bf16 (bf16.h): one algorithm, written once over the element
// type its products take, bf16 (oneDNN) or bf16 values held in fp32 (emulated). Both round the
// same values at the same places, so the two paths differ only in the order of fp32 sums.
//
// Per sequence the four products are batched over the heads: head h's q, k, v are columns
// [h hs, (h+1) hs) of the (T, 3C) rows, a batch stride of hs elements. Query rows are taken in
// blocks of kBlock, which see keys [0, r1) only (as the fp32 kernel, kernels.cc): the scores
// right of a block are never computed, read or written, and a block's scratch (NH, rows, r1)
// stays in cache.
#include <algorithm>
#include <cmath>
#include <vector>

#include "runtime/kernels/bf16.h"
#include "runtime/kernels/fastmath.h"

namespace trn::kernels {
namespace {

constexpr int kBlock = 64;

// Row reductions in kLanes independent lanes (element u goes to lane u % kLanes), the lanes then
// summed in a fixed order: one vector's worth of independent work per step, which the compiler
// vectorizes, where a single running sum or maximum stays scalar. The order is fixed, so a row's
// result is the same from run to run.
constexpr int kLanes = 16;

inline float lanes_sum(const float* l) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += l[i];
  return s;
}

float row_max(const float* x, int n) {
  float m[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = x[0];
  int u = 0;
  for (; u + kLanes <= n; u += kLanes)
    for (int l = 0; l < kLanes; ++l) m[l] = x[u + l] > m[l] ? x[u + l] : m[l];
  float mx = m[0];
  for (int l = 1; l < kLanes; ++l) mx = m[l] > mx ? m[l] : mx;
  for (; u < n; ++u) mx = x[u] > mx ? x[u] : mx;
  return mx;
}

// x[u] = exp((x[u] - mx) * scale) for u < n; returns their sum.
float exp_and_sum(float* x, int n, float mx, float scale) {
  float s[kLanes] = {};
  int u = 0;
  for (; u + kLanes <= n; u += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[u + l] = fast_exp((x[u + l] - mx) * scale);
      s[l] += x[u + l];
    }
  float sum = lanes_sum(s);
  for (; u < n; ++u) {
    x[u] = fast_exp((x[u] - mx) * scale);
    sum += x[u];
  }
  return sum;
}

float dot(const float* a, const float* b, int n) {
  float s[kLanes] = {};
  int u = 0;
  for (; u + kLanes <= n; u += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += a[u + l] * b[u + l];
  float d = lanes_sum(s);
  for (; u < n; ++u) d += a[u] * b[u];
  return d;
}

// The element type's rounding and products.
inline bf16 rounded(float x, bf16*) { return to_bf16(x); }
inline float rounded(float x, float*) { return from_bf16(to_bf16(x)); }
void batched(int batch, int M, int N, int K, const bf16* A, MatStrides sa, const bf16* B, MatStrides sb, float* C,
             MatStrides sc, float beta) {
  batched_matmul_bf16_onednn(batch, M, N, K, A, sa, B, sb, beta, C, sc);
}
void batched(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B, MatStrides sb, float* C,
             MatStrides sc, float beta) {
  batched_matmul_bf16_emulated(batch, M, N, K, A, sa, B, sb, beta, C, sc);
}

// Per-thread scratch: the rounded probabilities, scores' gradient and output gradient, and the
// probabilities' gradient in fp32.
template <typename E>
struct Scratch {
  std::vector<E> p, ds, dout;
  std::vector<float> dp;
};
template <typename E>
Scratch<E>& scratch() {
  thread_local Scratch<E> s;
  return s;
}

// One sequence: q, k, v rows (T, 3C) of E; out (T, C); att (NH, T, T).
template <typename E>
void forward_seq(float* out, float* att, const E* q, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(float(hs));
  const int64_t C3 = 3 * int64_t(C), TT = int64_t(T) * T, PT = int64_t(kBlock) * T;
  const E* k = q + C;
  const E* v = q + 2 * C;
  Scratch<E>& s = scratch<E>();
  s.p.resize(size_t(NH) * PT);
  for (int r0 = 0; r0 < T; r0 += kBlock) {
    const int r1 = std::min(T, r0 + kBlock), rows = r1 - r0;
    // scores (NH, rows, r1) = q k^T, unscaled, into att
    batched(NH, rows, r1, hs, q + r0 * C3, {hs, C3, 1}, k, {hs, 1, C3}, att + int64_t(r0) * T, {TT, T, 1}, 0.0f);
    for (int h = 0; h < NH; ++h)
      for (int t = r0; t < r1; ++t) {
        float* row = att + h * TT + int64_t(t) * T;
        E* pr = s.p.data() + h * PT + int64_t(t - r0) * T;
        const float mx = row_max(row, t + 1);
        const float inv = 1.0f / exp_and_sum(row, t + 1, mx, scale);
        for (int u = 0; u <= t; ++u) {
          row[u] *= inv;
          pr[u] = rounded(row[u], pr);
        }
        for (int u = t + 1; u < r1; ++u) {
          row[u] = 0.0f;
          pr[u] = E(0);
        }
      }
    // out rows (NH, rows, hs) = P v
    batched(NH, rows, hs, r1, s.p.data(), {PT, T, 1}, v, {hs, C3, 1}, out + int64_t(r0) * C, {hs, C, 1}, 0.0f);
  }
}

// Row block by row block: the block's dS and rounded P feed dq of its rows and add into dk, dv of
// the keys it sees, so the scratch is one block's (NH, rows, r1), which stays in cache.
template <typename E>
void backward_seq(float* dq, const float* dout, const E* q, const float* att, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(float(hs));
  const int64_t C3 = 3 * int64_t(C), TT = int64_t(T) * T, PT = int64_t(kBlock) * T;
  const E* k = q + C;
  const E* v = q + 2 * C;
  float* dk = dq + C;
  float* dv = dq + 2 * C;
  Scratch<E>& s = scratch<E>();
  s.p.resize(size_t(NH) * PT);
  s.ds.resize(size_t(NH) * PT);
  s.dp.resize(size_t(NH) * PT);
  s.dout.resize(size_t(T) * C);
  E* d = s.dout.data();
  for (size_t i = 0; i < size_t(T) * C; ++i) d[i] = rounded(dout[i], d);
  for (int t = 0; t < T; ++t) std::fill(dk + t * C3, dk + t * C3 + 2 * C, 0.0f);  // dk and dv accumulate
  for (int r0 = 0; r0 < T; r0 += kBlock) {
    const int r1 = std::min(T, r0 + kBlock), rows = r1 - r0;
    // dP (NH, rows, r1) = dout v^T; through the softmax: dS = P (dP - rowsum(P dP)) scale
    batched(NH, rows, r1, hs, d + int64_t(r0) * C, {hs, C, 1}, v, {hs, 1, C3}, s.dp.data(), {PT, T, 1}, 0.0f);
    for (int h = 0; h < NH; ++h)
      for (int t = r0; t < r1; ++t) {
        const float* ar = att + h * TT + int64_t(t) * T;
        const int64_t at = h * PT + int64_t(t - r0) * T;
        const float* dr = s.dp.data() + at;
        E* pr = s.p.data() + at;
        E* sr = s.ds.data() + at;
        const float pd = dot(ar, dr, t + 1);
        for (int u = 0; u <= t; ++u) {
          sr[u] = rounded(ar[u] * (dr[u] - pd) * scale, sr);
          pr[u] = rounded(ar[u], pr);
        }
        for (int u = t + 1; u < r1; ++u) sr[u] = pr[u] = E(0);
      }
    // dq rows (NH, rows, hs) = dS k; dk, dv of keys [0, r1) (NH, r1, hs) += dS^T q, P^T dout
    batched(NH, rows, hs, r1, s.ds.data(), {PT, T, 1}, k, {hs, C3, 1}, dq + int64_t(r0) * C3, {hs, C3, 1}, 0.0f);
    batched(NH, r1, hs, rows, s.ds.data(), {PT, 1, T}, q + int64_t(r0) * C3, {hs, C3, 1}, dk, {hs, C3, 1}, 1.0f);
    batched(NH, r1, hs, rows, s.p.data(), {PT, 1, T}, d + int64_t(r0) * C, {hs, C, 1}, dv, {hs, C3, 1}, 1.0f);
  }
}

}  // namespace

void attention_forward_bf16(float* out, float* att, Bf16Src qkv, float* qkv32, int B, int T, int C, int NH) {
  const size_t seq = size_t(T) * 3 * C, tt = size_t(NH) * T * T;
  const bool onednn = bf16_path() == Bf16Path::kOneDnn;
  for (int b = 0; b < B; ++b) {
    float* o = out + size_t(b) * T * C;
    float* a = att + b * tt;
    if (onednn && qkv.h) {
      forward_seq(o, a, qkv.h + b * seq, T, C, NH);
    } else if (qkv.f) {
      // (oneDNN without a bf16 form: the emulated products on the same values)
      forward_seq(o, a, qkv.f + b * seq, T, C, NH);
    } else {
      widen_bf16(qkv32, qkv.h + b * seq, seq);
      forward_seq<float>(o, a, qkv32, T, C, NH);
    }
  }
}

void attention_backward_bf16(float* dqkv, const float* dout, Bf16Src qkv, float* qkv32, const float* att, int B,
                             int T, int C, int NH) {
  const size_t seq = size_t(T) * 3 * C, tt = size_t(NH) * T * T;
  const bool onednn = bf16_path() == Bf16Path::kOneDnn;
  for (int b = 0; b < B; ++b) {
    float* dq = dqkv + b * seq;
    const float* d = dout + size_t(b) * T * C;
    const float* a = att + b * tt;
    if (onednn && qkv.h) {
      backward_seq(dq, d, qkv.h + b * seq, a, T, C, NH);
    } else if (qkv.f) {
      // (oneDNN without a bf16 form: the emulated products on the same values)
      backward_seq(dq, d, qkv.f + b * seq, a, T, C, NH);
    } else {
      widen_bf16(qkv32, qkv.h + b * seq, seq);
      backward_seq<float>(dq, d, qkv32, a, T, C, NH);
    }
  }
}

}  // namespace trn::kernels
