#include "runtime/kernels/bf16.h"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/kernels.h"

namespace trn::kernels {

void round_to_bf16(bf16* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = to_bf16(in[i]);
}

void widen_bf16(float* out, const bf16* in, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = from_bf16(in[i]);
}

namespace {

// to_bf16 on the bits of a float, with the NaN case as a select rather than a branch, so the
// loops below vectorize.
inline uint32_t bf16_bits(uint32_t v) {
  const uint32_t rounded = (v + 0x7fffu + ((v >> 16) & 1u)) >> 16, quiet = (v >> 16) | 0x40u;
  return (v & 0x7fffffffu) > 0x7f800000u ? quiet : rounded;
}

// out[i] = in[i] rounded through bf16; out and in do not overlap.
void round_through_copy(float* __restrict out, const float* __restrict in, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t v;
    std::memcpy(&v, in + i, sizeof v);
    v = bf16_bits(v) << 16;
    std::memcpy(out + i, &v, sizeof v);
  }
}

}  // namespace

void round_through_bf16(float* x, bf16* h, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t v;
    std::memcpy(&v, x + i, sizeof v);
    const uint32_t b = bf16_bits(v);
    if (h) h[i] = bf16(b);
    v = b << 16;
    std::memcpy(x + i, &v, sizeof v);
  }
}

// ---- CPU features and the path ----

bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

std::string cpu_features() {
  __builtin_cpu_init();
  std::string s;
  auto add = [&](bool has, const char* name) {
    if (!has) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(__builtin_cpu_supports("avx2"), "avx2");
  add(__builtin_cpu_supports("fma"), "fma");
  add(__builtin_cpu_supports("avx512f"), "avx512f");
  add(__builtin_cpu_supports("avx512bf16"), "avx512_bf16");
  if (s.empty()) s = "none of avx2 fma avx512f avx512_bf16";
  return s;
}

namespace {
// -1: not chosen yet; otherwise a Bf16Path. Chosen once; set_bf16_path replaces it.
std::atomic<int> g_path{-1};
}  // namespace

namespace {
// What oneDNN dispatches here, asked once per process.
const std::string& onednn_impl_here() {
  static const std::string impl = onednn_bf16_impl();
  return impl;
}
}  // namespace

Bf16Path parse_bf16_path(const std::string& v) {
  // auto: oneDNN only where it multiplies with the BF16 units; its AVX-512 fallback without them
  // (gemm:jit, converting) runs at a third of the emulated path's rate.
  if (v == "auto")
    return cpu_has_avx512_bf16() && !onednn_impl_here().empty() ? Bf16Path::kOneDnn : Bf16Path::kEmulated;
  if (v == "emulated") return Bf16Path::kEmulated;
  if (v == "onednn") {
    if (onednn_impl_here().empty())
      throw usage_error("--bf16-kernels onednn: oneDNN {} has no bf16 matmul for this CPU ({}); use auto or emulated",
                        onednn_version(), cpu_features());
    return Bf16Path::kOneDnn;
  }
  throw usage_error("--bf16-kernels takes auto, emulated or onednn (got '{}')", v);
}

void set_bf16_path(Bf16Path p) { g_path.store(int(p)); }

Bf16Path bf16_path() {
  int p = g_path.load();
  if (p < 0) {
    p = int(parse_bf16_path("auto"));
    g_path.store(p);
  }
  return Bf16Path(p);
}

const char* bf16_path_name(Bf16Path p) {
  return p == Bf16Path::kOneDnn ? "onednn" : "emulated (bf16 operands widened to fp32 in blocks, cblas_sgemm)";
}

std::string bf16_kernel_description() {
  const Bf16Path p = bf16_path();
  if (p == Bf16Path::kOneDnn)
    return fmt::format("CPU features: {}; bf16 matmul kernels: onednn (oneDNN {} matmul, {})", cpu_features(),
                       onednn_version(), onednn_impl_here());
  return fmt::format("CPU features: {}; bf16 matmul kernels: {}", cpu_features(), bf16_path_name(p));
}

// ---- GEMM ----

namespace {

// Blocks of the emulated GEMM: a (kMB x kKB) block of A and a (kKB x kNB) block of B, widened,
// are 0.5 MB and 1 MB of fp32, which stay in cache while sgemm packs them. kKB matches the depth
// OpenBLAS blocks by, so C is read and written once per 256 of K.
constexpr int kMB = 512, kKB = 256, kNB = 1024;

// Widens rows [r0, r1) x columns [c0, c1) of a row-major bf16 matrix (leading dimension ld)
// into a dense fp32 block.
void widen_block(float* out, const bf16* in, int ld, int r0, int r1, int c0, int c1) {
  const int w = c1 - c0;
  for (int r = r0; r < r1; ++r) widen_bf16(out + size_t(r - r0) * w, in + size_t(r) * ld + c0, size_t(w));
}

// One block of an operand for sgemm: rows [r0, r1) x columns [c0, c1) of its stored (row-major,
// leading dimension ld) matrix. bf16 values are widened into buf (dense, leading dimension
// c1 - c0); fp32 values are read where they are. Either way sgemm gets the same values in the same
// block shapes, so the result does not depend on the operand's form.
const float* operand_block(Bf16Src s, int ld, float* buf, int r0, int r1, int c0, int c1, int* ld_out) {
  if (s.f) {
    *ld_out = ld;
    return s.f + size_t(r0) * ld + c0;
  }
  widen_block(buf, s.h, ld, r0, r1, c0, c1);
  *ld_out = c1 - c0;
  return buf;
}

}  // namespace

bool gemm_without_products(int M, int N, int K, float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return true;
  if (K > 0) return false;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) C[size_t(m) * ldc + n] = beta == 0.0f ? 0.0f : beta * C[size_t(m) * ldc + n];
  return true;
}

void gemm_bf16_emulated(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                        float* C, int ldc) {
  if (gemm_without_products(M, N, K, beta, C, ldc)) return;
  thread_local std::vector<float> abuf, bbuf;
  if (!A.f) abuf.resize(size_t(kMB) * kKB);
  if (!B.f) bbuf.resize(size_t(kKB) * kNB);
  const CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
  for (int n0 = 0; n0 < N; n0 += kNB) {
    const int n1 = std::min(N, n0 + kNB), nb = n1 - n0;
    for (int k0 = 0; k0 < K; k0 += kKB) {
      const int k1 = std::min(K, k0 + kKB), kb = k1 - k0;
      // B's block in its stored orientation: (kb, nb), or (nb, kb) when transposed.
      int ldbb = 0;
      const float* bb = tb ? operand_block(B, ldb, bbuf.data(), n0, n1, k0, k1, &ldbb)
                           : operand_block(B, ldb, bbuf.data(), k0, k1, n0, n1, &ldbb);
      const float bt = k0 == 0 ? beta : 1.0f;
      for (int m0 = 0; m0 < M; m0 += kMB) {
        const int m1 = std::min(M, m0 + kMB), mb = m1 - m0;
        int ldab = 0;
        const float* ab = ta ? operand_block(A, lda, abuf.data(), k0, k1, m0, m1, &ldab)
                             : operand_block(A, lda, abuf.data(), m0, m1, k0, k1, &ldab);
        cblas_sgemm(CblasRowMajor, opa, opb, mb, nb, kb, 1.0f, ab, ldab, bb, ldbb, bt, C + size_t(m0) * ldc + n0,
                    ldc);
      }
    }
  }
}

void gemm_bf16_emulated(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                        float beta, float* C, int ldc) {
  gemm_bf16_emulated(ta, tb, M, N, K, Bf16Src(A), lda, Bf16Src(B), ldb, beta, C, ldc);
}

// gemm_bf16_onednn is in onednn.cc.

void gemm_bf16(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta, float* C,
               int ldc) {
  if (bf16_path() == Bf16Path::kOneDnn) gemm_bf16_onednn(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
  else gemm_bf16_emulated(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
}

// ---- The model's matmuls ----

void matmul_forward_bf16(float* out, Bf16Src inp, Bf16Src w, const float* bias, int N, int IC, int OC) {
  if (bf16_path() == Bf16Path::kOneDnn) return matmul_forward_bf16_onednn(out, inp, w, bias, N, IC, OC);
  float beta = 0.0f;
  if (bias) {
    for (int n = 0; n < N; ++n) std::memcpy(out + size_t(n) * OC, bias, sizeof(float) * OC);
    beta = 1.0f;
  }
  gemm_bf16(false, false, N, OC, IC, inp, IC, w, OC, beta, out, OC);
}

namespace {

// Both products of a matmul backward, dout already rounded (either form).
void matmul_backward_products(float* dinp, float* dw, Bf16Src dout, Bf16Src inp, Bf16Src w, int N, int IC, int OC) {
  if (dinp) gemm_bf16(false, true, N, IC, OC, dout, OC, w, OC, 0.0f, dinp, IC);
  if (dw) gemm_bf16(true, false, IC, OC, N, inp, IC, dout, OC, 1.0f, dw, OC);
}

}  // namespace

void matmul_backward_bf16(float* dinp, float* dw, float* db, const float* dout, bf16* dout_h, Bf16Src inp, Bf16Src w,
                          int N, int IC, int OC) {
  // One pass, row by row: db sums the fp32 row (bias_grad's sums, in its order), and the row is
  // rounded into dout_h.
  const bool with_db = dw && db;
  for (int n = 0; n < N; ++n) {
    const float* d = dout + size_t(n) * OC;
    if (with_db)
      for (int o = 0; o < OC; ++o) db[o] += d[o];
    round_to_bf16(dout_h + size_t(n) * OC, d, size_t(OC));
  }
  matmul_backward_products(dinp, dw, dout_h, inp, w, N, IC, OC);
}

void matmul_backward_bf16(float* dinp, float* dw, float* db, const float* dout, float* dout_r, Bf16Src inp,
                          Bf16Src w, int N, int IC, int OC) {
  // One pass, row by row: db sums the fp32 row (before dout_r may overwrite it; the sums are
  // bias_grad's, in its order), then the row is rounded into dout_r.
  const bool with_db = dw && db;
  for (int n = 0; n < N; ++n) {
    const float* d = dout + size_t(n) * OC;
    float* r = dout_r + size_t(n) * OC;
    if (with_db)
      for (int o = 0; o < OC; ++o) db[o] += d[o];
    if (r == d) round_through_bf16(r, nullptr, size_t(OC));
    else round_through_copy(r, d, size_t(OC));
  }
  matmul_backward_products(dinp, dw, Bf16Src::widened(dout_r), inp, w, N, IC, OC);
}

void lmhead_forward_bf16(float* logits, Bf16Src x, Bf16Src wte, int N, int C, int V) {
  gemm_bf16(false, true, N, V, C, x, C, wte, C, 0.0f, logits, V);
}

void lmhead_backward_bf16(float* dx, float* dwte, const float* dlogits, bf16* dlogits_h, Bf16Src x, Bf16Src wte, int N,
                          int C, int V) {
  round_to_bf16(dlogits_h, dlogits, size_t(N) * V);
  gemm_bf16(false, false, N, C, V, dlogits_h, V, wte, C, 0.0f, dx, C);
  gemm_bf16(true, false, V, C, N, dlogits_h, V, x, C, 1.0f, dwte, C);
}

void lmhead_backward_bf16(float* dx, float* dwte, float* dlogits, Bf16Src x, Bf16Src wte, int N, int C, int V) {
  round_through_bf16(dlogits, nullptr, size_t(N) * V);
  const Bf16Src d = Bf16Src::widened(dlogits);
  gemm_bf16(false, false, N, C, V, d, V, wte, C, 0.0f, dx, C);
  gemm_bf16(true, false, V, C, N, d, V, x, C, 1.0f, dwte, C);
}

// ---- Batched products (attention) ----

void batched_matmul_bf16_emulated(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B,
                                  MatStrides sb, float beta, float* C, MatStrides sc) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  TRN_CHECK(K > 0 && sc.col == 1 && (sa.col == 1 || sa.row == 1) && (sb.col == 1 || sb.row == 1));
  // A matrix with unit column stride is row-major (leading dimension its row stride); one with
  // unit row stride is its transpose, row-major.
  const bool ta = sa.col != 1, tb = sb.col != 1;
  const int lda = int(ta ? sa.col : sa.row), ldb = int(tb ? sb.col : sb.row);
  for (int i = 0; i < batch; ++i)
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                A + i * sa.batch, lda, B + i * sb.batch, ldb, beta, C + i * sc.batch, int(sc.row));
}

}  // namespace trn::kernels
