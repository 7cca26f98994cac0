// Blockwise causal attention (kernels.h attention_forward/_rows/backward, bf16.h *_bf16): one
// algorithm, written once over the element type its products take and whether it rounds.
//
//   fp32                 E = float, no rounding, products by oneDNN's fp32 matmul where the
//                        model's fp32 matmuls take it (AVX-512), else cblas_sgemm
//   bf16, emulated path  E = float holding bf16 values, rounded, products by cblas_sgemm
//   bf16, oneDNN path    E = bf16, rounded, products by oneDNN's bf16 matmul
//
// Query rows are taken in blocks of kRows and keys in blocks of kCols (a multiple of kRows, so
// with queries from position 0 a key block starts at or before the first row of every query block
// it meets). Key blocks right of a query block's last row are skipped; inside the diagonal block
// the entries right of a row are set to zero. Forward runs an online softmax over a query block's key blocks: the running
// row maximum m and sum l, the output accumulated unnormalised and rescaled by exp(m_old - m_new)
// when the maximum grows, divided by l at the end; it keeps out and lse = m + log l, not the
// probabilities. The forward loop (forward_rows) takes query rows at an offset t0 into the key
// sequence, with q, k and v each at its own row stride: training calls it with t0 = 0 on a
// sequence's qkv rows, the KV-cached decoders (attention_forward_rows) with the new rows against
// their cache. Backward recomputes each block's probabilities P = exp(s - lse) from q, k and
// lse, takes dP = dout v^T, dS = P (dP - D) scale with the row term D = dout . out, and adds
// dS k into dq, dS^T q into dk and P^T dout into dv.
//
// Rounding under bf16 (as the full-matrix kernel it replaced, and PyTorch's autocast): the
// products take bf16 q, k, v; the scores and the softmax are fp32; the output gradient, the
// probabilities and the scores' gradient are rounded to bf16 before the products that take them.
// Backward rounds the same values at the same points as the full-matrix kernel did (P comes from
// lse instead of a stored matrix, equal up to fp32 rounding). Forward is where blockwise differs:
// it rounds the unnormalised exp(s - m) of the running maximum (in (0, 1], as the flash kernels do)
// and divides the fp32 sum by l, where the full-matrix kernel rounded the normalised
// probabilities. D is dout . out with the saved (bf16) output.
//
// Per sequence, the products are batched over the KV heads: for j < H/K, query heads
// kv * (H/K) + j for every kv read KV head kv, so q, out and lse have batch stride H/K heads, k,
// v one. Every matrix of a batch is a product of its own (cblas one at a time; oneDNN's batched
// matmul computes each matrix of the batch alike, whatever the batch size), and a head's rows are
// visited in a fixed order, so the result for a (sequence, head) depends neither on B, nor on how
// many heads the rank holds, nor on threads. dk and dv sum their group's query heads in order
// j = 0, 1, ...
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "runtime/kernels/bf16.h"
#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"

namespace trn::kernels {
namespace {

// Rows x keys per block: a block's scores for a batch of heads are (K, kRows, kCols) floats. 128 x
// 128 measured fastest of 64-128 rows x 64-256 keys for Llama-small and GPT-2-small shapes
// (bench/results/2026-12-06-blockwise-attention.md): fewer rows make too many small products at
// T = 256, more keys a scratch past L2 for 12 heads.
constexpr int kRows = kAttentionRows;
constexpr int kCols = kAttentionKeys;
static_assert(kCols % kRows == 0);
constexpr int64_t kBlockElems = int64_t(kRows) * kCols;

// Row reductions in kLanes independent lanes summed in a fixed order: they vectorize, and a
// row's result is the same from run to run and on every CPU.
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

// x[u] = exp(x[u] scale - sub) for u < n; returns their sum.
float exp_and_sum(float* x, int n, float scale, float sub) {
  float s[kLanes] = {};
  int u = 0;
  for (; u + kLanes <= n; u += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      x[u + l] = fast_exp(x[u + l] * scale - sub);
      s[l] += x[u + l];
    }
  float sum = lanes_sum(s);
  for (; u < n; ++u) {
    x[u] = fast_exp(x[u] * scale - sub);
    sum += x[u];
  }
  return sum;
}

inline float value(float x) { return x; }
inline float value(bf16 h) { return from_bf16(h); }

template <typename E>
float dot(const E* a, const float* b, int n) {
  float s[kLanes] = {};
  int u = 0;
  for (; u + kLanes <= n; u += kLanes)
    for (int l = 0; l < kLanes; ++l) s[l] += value(a[u + l]) * b[u + l];
  float d = lanes_sum(s);
  for (; u < n; ++u) d += value(a[u]) * b[u];
  return d;
}

std::atomic<bool> g_attention_blas{false};

// The element type's rounding (kRound) and products: C[i] = beta C[i] + A[i] B[i], strides as
// bf16.h's MatStrides.
template <typename E, bool kRound>
struct Arith;
template <bool kRound>
struct Arith<float, kRound> {
  static float round(float x) { return kRound ? from_bf16(to_bf16(x)) : x; }
  static void batched(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B,
                      MatStrides sb, float beta, float* C, MatStrides sc) {
    // fp32: oneDNN where the model's fp32 matmuls take it (AVX-512), as one batched primitive;
    // the emulated bf16 path multiplies with cblas_sgemm by definition.
    if (!kRound && !g_attention_blas.load(std::memory_order_relaxed) && fp32_matmuls_onednn())
      return batched_matmul_f32_onednn(batch, M, N, K, A, sa, B, sb, beta, C, sc);
    const bool ta = sa.col != 1, tb = sb.col != 1;
    const int lda = int(ta ? sa.col : sa.row), ldb = int(tb ? sb.col : sb.row);
    for (int i = 0; i < batch; ++i)
      cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
                  1.0f, A + i * sa.batch, lda, B + i * sb.batch, ldb, beta, C + i * sc.batch, int(sc.row));
  }
};
template <>
struct Arith<bf16, true> {
  static bf16 round(float x) { return to_bf16(x); }
  static void batched(int batch, int M, int N, int K, const bf16* A, MatStrides sa, const bf16* B,
                      MatStrides sb, float beta, float* C, MatStrides sc) {
    batched_matmul_bf16_onednn(batch, M, N, K, A, sa, B, sb, beta, C, sc);
  }
};

// Per-thread scratch: a block's scores (or probabilities) and their gradient in fp32, their
// rounded copies in E, the running maxima, sums and rescale factors of a block's rows, the rounded
// output gradient of a sequence, and the row terms D.
template <typename E>
struct Scratch {
  std::vector<float> s, dp, m, l, alpha, D;
  std::vector<E> pe, dse, dout;
};
template <typename E>
Scratch<E>& scratch() {
  thread_local Scratch<E> s;
  return s;
}

// Query rows i < n at positions t0 + i, row i attending to the keys and values at positions
// [0, t0 + i]: q (n, qs) with its H heads of hd first, k and v (t0 + n, ks) with K heads each, out
// (n, os) overwritten, lse[h * ls + i] unless lse is null. Training passes one sequence's qkv rows
// with t0 = 0 (forward_seq); the KV-cached decoder n new rows against its cache.
//
// Query blocks are counted from row 0, key blocks from position 0. With t0 = 0 every row of a
// query block meets at least one key of every key block it visits (kCols is a multiple of kRows);
// with t0 > 0 the last key block of a query block may lie wholly right of its first rows, which
// then take nothing from it (rescale 1, zero probabilities). A row's first key block (c0 = 0)
// always holds its position 0, so its maximum and sum start there.
//
// pack (n = 1, a decoded row): the rows of a product are a group's H/K query heads, all at
// position t0, instead of one head's rows at successive positions; they read the same keys, so a
// key block is multiplied once per KV head instead of once per query head.
//
// kend bounds the keys: positions [0, kend) exist (t0 + n for a cache or a sequence). A context-
// parallel block of keys wholly before its queries passes t0 = kend, so every row sees them all.
template <typename E, bool kRound>
void forward_rows(float* out, int64_t os, float* lse, int64_t ls, const E* q, int64_t qs, const E* k, const E* v,
                  int64_t ks, int t0, int n, int kend, int H, int K, int hd, bool pack = false) {
  using A = Arith<E, kRound>;
  const int group = H / K;
  // Per product: `heads` passes over the group, `nrows` rows apart by qrs in q and ors in out.
  const int heads = pack ? 1 : group, nrows = pack ? group : n;
  const int64_t qrs = pack ? hd : qs, ors = pack ? hd : os;
  auto pos = [&](int r) { return pack ? t0 : t0 + r; };  // a row's position
  const float scale = 1.0f / std::sqrt(float(hd));
  Scratch<E>& sc = scratch<E>();
  sc.s.resize(size_t(K) * kBlockElems);
  sc.m.resize(size_t(K) * kRows);
  sc.l.resize(size_t(K) * kRows);
  sc.alpha.resize(size_t(K) * kRows);
  if constexpr (kRound) sc.pe.resize(size_t(K) * kBlockElems);
  float* S = sc.s.data();
  E* P;
  if constexpr (kRound)
    P = sc.pe.data();
  else
    P = S;  // fp32: the products take the probabilities as computed
  const MatStrides s_rows{kBlockElems, kCols, 1};
  for (int j = 0; j < heads; ++j) {
    const E* qj = q + int64_t(j) * hd;
    float* o = out + int64_t(j) * hd;
    const MatStrides q_str{int64_t(group) * hd, qrs, 1}, o_str{int64_t(group) * hd, ors, 1};
    for (int r0 = 0; r0 < nrows; r0 += kRows) {
      const int r1 = std::min(nrows, r0 + kRows), rows = r1 - r0;
      const int end = std::min(pos(r1 - 1) + 1, kend);  // keys [0, end) are seen by some row of the block
      for (int c0 = 0; c0 < end; c0 += kCols) {
        const int c1 = std::min(end, c0 + kCols), cols = c1 - c0;
        // scores (K, rows, cols) = q k^T, unscaled
        A::batched(K, rows, cols, hd, qj + r0 * qrs, q_str, k + c0 * ks, {hd, 1, ks}, 0.0f, S, s_rows);
        for (int kv = 0; kv < K; ++kv)
          for (int i = 0; i < rows; ++i) {
            float* row = S + kv * kBlockElems + int64_t(i) * kCols;
            E* prow = P + kv * kBlockElems + int64_t(i) * kCols;
            const int nk = std::min(cols, pos(r0 + i) - c0 + 1);  // keys u <= the row's position
            if (nk <= 0) {  // (c0 > 0) the whole block lies right of this row
              sc.alpha[kv * kRows + i] = 1.0f;
              for (int u = 0; u < cols; ++u) prow[u] = E(0);
              continue;
            }
            // m: the running maximum of the scaled scores (scale > 0, so the maximum of the
            // unscaled ones, scaled)
            float& m = sc.m[kv * kRows + i];
            float& l = sc.l[kv * kRows + i];
            const float bm = row_max(row, nk) * scale;
            const float mx = c0 == 0 ? bm : std::max(m, bm);
            const float sum = exp_and_sum(row, nk, scale, mx);
            if (c0 == 0) {
              l = sum;
            } else {
              const float alpha = fast_exp(m - mx);
              sc.alpha[kv * kRows + i] = alpha;
              l = l * alpha + sum;
            }
            m = mx;
            if constexpr (kRound)
              for (int u = 0; u < nk; ++u) prow[u] = A::round(row[u]);
            for (int u = nk; u < cols; ++u) prow[u] = E(0);
          }
        if (c0 > 0)  // the output so far, to the new maxima
          for (int kv = 0; kv < K; ++kv)
            for (int i = 0; i < rows; ++i) {
              float* orow = o + kv * group * hd + (r0 + i) * ors;
              const float alpha = sc.alpha[kv * kRows + i];
              for (int x = 0; x < hd; ++x) orow[x] *= alpha;
            }
        // out rows (K, rows, hd) += P v
        A::batched(K, rows, hd, cols, P, s_rows, v + c0 * ks, {hd, ks, 1}, c0 == 0 ? 0.0f : 1.0f, o + r0 * ors,
                   o_str);
      }
      for (int kv = 0; kv < K; ++kv)
        for (int i = 0; i < rows; ++i) {
          const float l = sc.l[kv * kRows + i], inv = 1.0f / l;
          float* orow = o + kv * group * hd + (r0 + i) * ors;
          for (int x = 0; x < hd; ++x) orow[x] *= inv;
          const int64_t at = pack ? int64_t(kv * group + r0 + i) * ls : int64_t(kv * group + j) * ls + r0 + i;
          if (lse) lse[at] = sc.m[kv * kRows + i] + std::log(l);
        }
    }
  }
}

// One sequence: qkv (T, R) of E, out (T, H hd), lse (H, T).
template <typename E, bool kRound>
void forward_seq(float* out, float* lse, const E* qkv, int T, int H, int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd;
  forward_rows<E, kRound>(out, int64_t(H) * hd, lse, T, qkv, R, qkv + int64_t(H) * hd, qkv + int64_t(H + K) * hd, R, 0,
                          T, T, H, K, hd);
}

// Query rows i < n at positions t0 + i against the keys [0, min(t0 + i, kend - 1)], as
// forward_rows: dq (n, dqs) rows (overwritten unless accumulate, else added to), dk and dv (kend,
// dks) added to; d (n, ds) the output gradient as the products take it (rounded under bf16); D
// and lse (H, ls) the row terms and log-sum-exps of the rows (the whole attention's, so a block's
// probabilities are its share of each row's).
template <typename E, bool kRound>
void backward_rows(float* dq0, int64_t dqs, float* dk, float* dv, int64_t dks, const E* d, int64_t ds, const float* D,
                   const float* lse, int64_t ls, const E* q0, int64_t qs, const E* k, const E* v, int64_t ks, int t0,
                   int n, int kend, int H, int K, int hd, bool accumulate) {
  using A = Arith<E, kRound>;
  const int group = H / K;
  const float scale = 1.0f / std::sqrt(float(hd));
  Scratch<E>& sc = scratch<E>();
  sc.s.resize(size_t(K) * kBlockElems);
  sc.dp.resize(size_t(K) * kBlockElems);
  if constexpr (kRound) {
    sc.pe.resize(size_t(K) * kBlockElems);
    sc.dse.resize(size_t(K) * kBlockElems);
  }
  float* S = sc.s.data();
  float* dP = sc.dp.data();
  E *P, *dS;
  if constexpr (kRound) {
    P = sc.pe.data();
    dS = sc.dse.data();
  } else {
    P = S;
    dS = dP;
  }
  const MatStrides s_rows{kBlockElems, kCols, 1}, s_cols{kBlockElems, 1, kCols}, k_str{hd, ks, 1},
      dk_str{hd, dks, 1};
  for (int j = 0; j < group; ++j) {
    const E* q = q0 + int64_t(j) * hd;
    const E* dj = d + int64_t(j) * hd;
    float* dq = dq0 + int64_t(j) * hd;
    const MatStrides q_str{int64_t(group) * hd, qs, 1}, d_str{int64_t(group) * hd, ds, 1},
        dq_str{int64_t(group) * hd, dqs, 1};
    for (int r0 = 0; r0 < n; r0 += kRows) {
      const int r1 = std::min(n, r0 + kRows), rows = r1 - r0;
      const int end = std::min(t0 + r1, kend);  // keys [0, end) are seen by some row of the block
      for (int c0 = 0; c0 < end; c0 += kCols) {
        const int c1 = std::min(end, c0 + kCols), cols = c1 - c0;
        A::batched(K, rows, cols, hd, q + r0 * qs, q_str, k + c0 * ks, {hd, 1, ks}, 0.0f, S, s_rows);
        A::batched(K, rows, cols, hd, dj + r0 * ds, d_str, v + c0 * ks, {hd, 1, ks}, 0.0f, dP, s_rows);
        for (int kv = 0; kv < K; ++kv) {
          const int h = kv * group + j;
          for (int i = 0; i < rows; ++i) {
            const int64_t at = kv * kBlockElems + int64_t(i) * kCols;
            float* srow = S + at;
            float* dprow = dP + at;
            E* prow = P + at;
            E* dsrow = dS + at;
            const int nk = std::max(0, std::min(cols, t0 + r0 + i - c0 + 1));
            const float l = lse[int64_t(h) * ls + r0 + i], Di = D[int64_t(h) * ls + r0 + i];
            for (int u = 0; u < nk; ++u) {
              const float p = fast_exp(srow[u] * scale - l);
              const float dsv = p * (dprow[u] - Di) * scale;
              if constexpr (kRound) {
                prow[u] = A::round(p);
                dsrow[u] = A::round(dsv);
              } else {
                prow[u] = p;
                dsrow[u] = dsv;
              }
            }
            for (int u = nk; u < cols; ++u) prow[u] = dsrow[u] = E(0);
          }
        }
        // dq rows (K, rows, hd) (+)= dS k; dk, dv of the block's keys (K, cols, hd) += dS^T q, P^T dout
        A::batched(K, rows, hd, cols, dS, s_rows, k + c0 * ks, k_str, c0 == 0 && !accumulate ? 0.0f : 1.0f,
                   dq + r0 * dqs, dq_str);
        A::batched(K, cols, hd, rows, dS, s_cols, q + r0 * qs, q_str, 1.0f, dk + c0 * dks, dk_str);
        A::batched(K, cols, hd, rows, P, s_cols, dj + r0 * ds, d_str, 1.0f, dv + c0 * dks, dk_str);
      }
    }
  }
}

// One sequence: dqkv (T, R) overwritten; d (T, H hd) the output gradient as the products take it
// (rounded under bf16); D (H, T) the row terms; lse (H, T).
template <typename E, bool kRound>
void backward_seq(float* dqkv, const E* d, const float* D, const E* qkv, const float* lse, int T, int H,
                  int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd;
  float* dk = dqkv + int64_t(H) * hd;
  float* dv = dqkv + int64_t(H + K) * hd;
  for (int t = 0; t < T; ++t)
    std::fill(dk + t * R, dk + t * R + 2 * int64_t(K) * hd, 0.0f);  // they accumulate
  backward_rows<E, kRound>(dqkv, R, dk, dv, R, d, OC, D, lse, T, qkv, R, qkv + int64_t(H) * hd,
                           qkv + int64_t(H + K) * hd, R, 0, T, T, H, K, hd, false);
}

// D (H, T) = rows of dout . out for one sequence (dout as the products take it; out read by get).
template <typename E, typename Get>
void row_terms(float* D, const E* d, Get&& out_at, int T, int H, int hd) {
  const int64_t OC = int64_t(H) * hd;
  std::vector<float> o(hd);
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t) {
      const int64_t at = t * OC + int64_t(h) * hd;
      for (int x = 0; x < hd; ++x) o[x] = out_at(at + x);
      D[int64_t(h) * T + t] = dot(d + at, o.data(), hd);
    }
}

}  // namespace

void set_attention_blas(bool on) { g_attention_blas.store(on); }

void attention_forward_rows(float* out, int64_t out_stride, float* lse, int64_t lse_stride, const float* q,
                            int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int t0, int n, int H,
                            int K, int hd) {
  // A decoded row packs its groups' heads; training's forward (forward_seq) never packs, so its
  // products keep their shapes whatever T.
  forward_rows<float, false>(out, out_stride, lse, lse_stride, q, q_stride, k, v, kv_stride, t0, n, t0 + n, H, K, hd,
                             n == 1 && H > K);
}

void attention_block_forward(float* out, int64_t out_stride, float* lse, int64_t lse_stride, const float* q,
                             int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int n, int nk,
                             bool causal, int H, int K, int hd) {
  forward_rows<float, false>(out, out_stride, lse, lse_stride, q, q_stride, k, v, kv_stride, causal ? 0 : nk, n, nk,
                             H, K, hd);
}

void attention_block_backward(float* dq, int64_t dq_stride, float* dk, float* dv, int64_t dkv_stride,
                              const float* dout, int64_t dout_stride, const float* D, const float* lse,
                              int64_t row_stride, const float* q, int64_t q_stride, const float* k, const float* v,
                              int64_t kv_stride, int n, int nk, bool causal, int H, int K, int hd) {
  backward_rows<float, false>(dq, dq_stride, dk, dv, dkv_stride, dout, dout_stride, D, lse, row_stride, q, q_stride,
                              k, v, kv_stride, causal ? 0 : nk, n, nk, H, K, hd, true);
}

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int H, int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd;
  for (int b = 0; b < B; ++b)
    forward_seq<float, false>(out + b * T * OC, lse + int64_t(b) * H * T, qkv + b * T * R, T, H, K, hd);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int B, int T, int H, int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd;
  Scratch<float>& sc = scratch<float>();
  for (int b = 0; b < B; ++b) {
    const float* d = dout + b * T * OC;
    const float* o = out + b * T * OC;
    sc.D.resize(size_t(H) * T);
    row_terms(
        sc.D.data(), d, [o](int64_t i) { return o[i]; }, T, H, hd);
    backward_seq<float, false>(dqkv + b * T * R, d, sc.D.data(), qkv + b * T * R, lse + int64_t(b) * H * T, T,
                               H, K, hd);
  }
}

void attention_forward_bf16(float* out, float* lse, Bf16Src qkv, float* qkv32, int B, int T, int H, int K,
                            int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd, seq = T * R;
  const bool onednn = bf16_path() == Bf16Path::kOneDnn;
  for (int b = 0; b < B; ++b) {
    float* o = out + b * T * OC;
    float* l = lse + int64_t(b) * H * T;
    if (onednn && qkv.h) {
      forward_seq<bf16, true>(o, l, qkv.h + b * seq, T, H, K, hd);
    } else if (qkv.f) {
      // (oneDNN without a bf16 form: the emulated products on the same values)
      forward_seq<float, true>(o, l, qkv.f + b * seq, T, H, K, hd);
    } else {
      widen_bf16(qkv32, qkv.h + b * seq, seq);
      forward_seq<float, true>(o, l, qkv32, T, H, K, hd);
    }
  }
}

void attention_backward_bf16(float* dqkv, const float* dout, Bf16Src qkv, float* qkv32, Bf16Src out,
                             const float* lse, int B, int T, int H, int K, int hd) {
  const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd, seq = T * R;
  const bool onednn = bf16_path() == Bf16Path::kOneDnn;
  for (int b = 0; b < B; ++b) {
    float* dq = dqkv + b * seq;
    const float* d = dout + b * T * OC;
    const float* l = lse + int64_t(b) * H * T;
    const Bf16Src o = out + size_t(b * T * OC);
    auto out_at = [o](int64_t i) { return from_bf16(o.at(size_t(i))); };
    if (onednn && qkv.h) {
      Scratch<bf16>& sc = scratch<bf16>();
      sc.dout.resize(size_t(T * OC));
      round_to_bf16(sc.dout.data(), d, size_t(T * OC));
      sc.D.resize(size_t(H) * T);
      row_terms(sc.D.data(), sc.dout.data(), out_at, T, H, hd);
      backward_seq<bf16, true>(dq, sc.dout.data(), sc.D.data(), qkv.h + b * seq, l, T, H, K, hd);
    } else {
      Scratch<float>& sc = scratch<float>();
      sc.dout.resize(size_t(T * OC));
      for (int64_t i = 0; i < T * OC; ++i) sc.dout[i] = from_bf16(to_bf16(d[i]));
      sc.D.resize(size_t(H) * T);
      row_terms(sc.D.data(), sc.dout.data(), out_at, T, H, hd);
      const float* q = qkv.f ? qkv.f + b * seq : qkv32;
      if (!qkv.f) widen_bf16(qkv32, qkv.h + b * seq, seq);
      backward_seq<float, true>(dq, sc.dout.data(), sc.D.data(), q, l, T, H, K, hd);
    }
  }
}

}  // namespace trn::kernels
