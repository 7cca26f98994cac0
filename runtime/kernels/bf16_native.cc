// The native bf16 GEMM for CPUs with AVX512-BF16. Only the micro-kernel uses the instructions
// (a target attribute, so the rest of the build stays at -march); bf16_path() calls it only when
// the CPU reports avx512bf16.
//
// Blocking: for each (kKB x kNB) block of op(B) and (kMB x kKB) block of op(A), both are packed
// with pairs of consecutive K interleaved into 32-bit words, the layout vdpbf16ps reads:
//   Bp[p][n] = B(2p, n) | B(2p+1, n) << 16   (n padded to a multiple of 16 with zeros)
//   Ap[m][p] = A(m, 2p) | A(m, 2p+1) << 16   (an odd K padded with a zero)
// The micro-kernel keeps a tile of up to 4 rows x 32 columns of C in registers: per pair p it
// broadcasts Ap[m][p] and multiplies it into two vectors of Bp[p], summing each pair's two
// products into fp32 accumulators. The portable micro-kernel does the same arithmetic in C on
// the same packed blocks.
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"

namespace trn::kernels {
namespace {

constexpr int kMB = 128, kKB = 256, kNB = 512;
constexpr int kRows = 4, kCols = 32;

// C tile (rows x cols) at c: C = acc (load_c false) or bt * C + acc.
using MicroKernel = void (*)(int rows, int cols, const uint32_t* ap, int kp, const uint32_t* bp, int nbp, float* c,
                             int ldc, float bt, bool load_c);

void micro_portable(int rows, int cols, const uint32_t* ap, int kp, const uint32_t* bp, int nbp, float* c, int ldc,
                    float bt, bool load_c) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int p = 0; p < kp; ++p) {
        const uint32_t a = ap[size_t(r) * kp + p], b = bp[size_t(p) * nbp + j];
        acc += from_bf16(bf16(a & 0xffff)) * from_bf16(bf16(b & 0xffff)) +
               from_bf16(bf16(a >> 16)) * from_bf16(bf16(b >> 16));
      }
      float& out = c[size_t(r) * ldc + j];
      out = load_c ? bt * out + acc : acc;
    }
}

template <int R, int NV>
__attribute__((target("avx512f,avx512bf16"))) inline void micro_avx512_tile(int cols, const uint32_t* ap, int kp,
                                                                              const uint32_t* bp, int nbp, float* c,
                                                                              int ldc, float bt, bool load_c) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int p = 0; p < kp; ++p) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(bp + size_t(p) * nbp + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(int(ap[size_t(r) * kp + p]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a, (__m512bh)b[v]);
    }
  }
  const __m512 vbt = _mm512_set1_ps(bt);
  for (int v = 0; v < NV; ++v) {
    const int n = std::min(16, cols - 16 * v);
    const __mmask16 mask = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
    for (int r = 0; r < R; ++r) {
      float* cr = c + size_t(r) * ldc + 16 * v;
      __m512 out = acc[r][v];
      if (load_c) out = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, cr), vbt, out);
      _mm512_mask_storeu_ps(cr, mask, out);
    }
  }
}

template <int R>
__attribute__((target("avx512f,avx512bf16"))) void micro_avx512_rows(int cols, const uint32_t* ap, int kp,
                                                                     const uint32_t* bp, int nbp, float* c, int ldc,
                                                                     float bt, bool load_c) {
  if (cols > 16) micro_avx512_tile<R, 2>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c);
  else micro_avx512_tile<R, 1>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c);
}

__attribute__((target("avx512f,avx512bf16"))) void micro_avx512(int rows, int cols, const uint32_t* ap, int kp,
                                                                const uint32_t* bp, int nbp, float* c, int ldc,
                                                                float bt, bool load_c) {
  switch (rows) {
    case 4: micro_avx512_rows<4>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c); break;
    case 3: micro_avx512_rows<3>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c); break;
    case 2: micro_avx512_rows<2>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c); break;
    default: micro_avx512_rows<1>(cols, ap, kp, bp, nbp, c, ldc, bt, load_c); break;
  }
}

inline uint32_t pair(bf16 lo, bf16 hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

void gemm_packed(MicroKernel micro, bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb,
                 float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) C[size_t(m) * ldc + n] = beta == 0.0f ? 0.0f : beta * C[size_t(m) * ldc + n];
    return;
  }
  // Packing reads either form of an operand as bf16 (Bf16Src::at), so both give the same packed blocks.
  auto a_at = [&](int m, int k) -> bf16 { return A.at(ta ? size_t(k) * lda + m : size_t(m) * lda + k); };
  auto b_at = [&](int k, int n) -> bf16 { return B.at(tb ? size_t(n) * ldb + k : size_t(k) * ldb + n); };
  thread_local std::vector<uint32_t> ap, bp;
  ap.resize(size_t(kMB) * (kKB / 2));
  bp.resize(size_t(kKB / 2) * kNB);
  for (int n0 = 0; n0 < N; n0 += kNB) {
    const int n1 = std::min(N, n0 + kNB), nb = n1 - n0, nbp = (nb + 15) / 16 * 16;
    for (int k0 = 0; k0 < K; k0 += kKB) {
      const int k1 = std::min(K, k0 + kKB), kp = (k1 - k0 + 1) / 2;
      for (int p = 0; p < kp; ++p) {
        const int k = k0 + 2 * p;
        uint32_t* row = bp.data() + size_t(p) * nbp;
        for (int n = 0; n < nb; ++n) row[n] = pair(b_at(k, n0 + n), k + 1 < k1 ? b_at(k + 1, n0 + n) : bf16(0));
        for (int n = nb; n < nbp; ++n) row[n] = 0;
      }
      const bool load_c = k0 > 0 || beta != 0.0f;
      const float bt = k0 == 0 ? beta : 1.0f;
      for (int m0 = 0; m0 < M; m0 += kMB) {
        const int m1 = std::min(M, m0 + kMB);
        for (int m = m0; m < m1; ++m) {
          uint32_t* row = ap.data() + size_t(m - m0) * kp;
          for (int p = 0; p < kp; ++p) {
            const int k = k0 + 2 * p;
            row[p] = pair(a_at(m, k), k + 1 < k1 ? a_at(m, k + 1) : bf16(0));
          }
        }
        for (int m = m0; m < m1; m += kRows) {
          const int rows = std::min(kRows, m1 - m);
          for (int n = 0; n < nb; n += kCols)
            micro(rows, std::min(kCols, nb - n), ap.data() + size_t(m - m0) * kp, kp, bp.data() + n, nbp,
                  C + size_t(m) * ldc + n0 + n, ldc, bt, load_c);
        }
      }
    }
  }
}

}  // namespace

void gemm_bf16_native(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                      float* C, int ldc) {
  if (!cpu_has_avx512_bf16())
    throw internal_error("the native bf16 GEMM called on a CPU without AVX512-BF16 ({})", cpu_features());
  gemm_packed(micro_avx512, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16_packed_portable(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb,
                               float beta, float* C, int ldc) {
  gemm_packed(micro_portable, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

void gemm_bf16_native(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                      float beta, float* C, int ldc) {
  gemm_bf16_native(ta, tb, M, N, K, Bf16Src(A), lda, Bf16Src(B), ldb, beta, C, ldc);
}

void gemm_bf16_packed_portable(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B,
                               int ldb, float beta, float* C, int ldc) {
  gemm_bf16_packed_portable(ta, tb, M, N, K, Bf16Src(A), lda, Bf16Src(B), ldb, beta, C, ldc);
}

}  // namespace trn::kernels
