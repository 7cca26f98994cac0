// bf16 kernels for --precision bf16: matmuls whose operands are bf16 (the upper 16 bits of an
// IEEE float, round to nearest even) and whose products are summed in fp32.
//
// Two implementations of the one bf16 GEMM, chosen once per process (bf16_path()):
//   emulated  any x86-64 CPU: the bf16 operands are widened to fp32 in cache-sized blocks and
//             multiplied by cblas_sgemm. A product of two bf16 values (8-bit significands) is
//             exact in fp32, so this is the arithmetic of a native bf16 dot product with fp32
//             accumulation, up to the order of the sums.
//   onednn    oneDNN's matmul primitive on bf16 operands with fp32 accumulation
//             (onednn.cc); on CPUs with AVX512-BF16 its brgemm kernels run vdpbf16ps at about
//             twice sgemm's rate (bench/results/2026-12-02-bf16-onednn.md). oneDNN 2.x has no bf16
//             matmul below AVX-512.
// --bf16-kernels auto|emulated|onednn (set_bf16_path) overrides the choice. auto takes onednn
// where the CPU has AVX512-BF16 and oneDNN dispatches a bf16 kernel for it, else emulated; onednn
// where oneDNN has no bf16 matmul for the CPU is a usage error.
//
// Like kernels.h, everything here is single-threaded (the model runs one per compute thread);
// the scratch the kernels need is per thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace trn::kernels {

using bf16 = uint16_t;  // the bit pattern; no arithmetic on it

// Round to nearest even; a NaN stays a (quiet) NaN. The NaN case is a select, not a branch, so
// loops over it vectorize.
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return bf16((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

inline float from_bf16(bf16 h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

void round_to_bf16(bf16* out, const float* in, size_t n);
void widen_bf16(float* out, const bf16* in, size_t n);
// Rounds x in place through bf16: x[i] = from_bf16(to_bf16(x[i])), and stores the bf16 values in
// h too unless h is null. One pass gives a value both as bf16 (to keep) and as fp32 (to multiply
// now, with no widening).
void round_through_bf16(float* x, bf16* h, size_t n);

// A matrix operand of the bf16 GEMMs: bf16 values (h), or bf16 values held widened in fp32 (f),
// every element of f being exactly a bf16 value (from round_through_bf16 or from_bf16), or both
// (the same values, at the same leading dimension). The forms stand for the same operand, so a
// GEMM gives the same result bit for bit whichever it gets: the emulated path reads f in place
// when it is there (sgemm, no widening), oneDNN reads h when it is there (no rounding). Neither
// set: no operand.
struct Bf16Src {
  const bf16* h = nullptr;
  const float* f = nullptr;
  Bf16Src() = default;
  Bf16Src(const bf16* p) : h(p) {}  // NOLINT(google-explicit-constructor): bf16 arrays are operands
  static Bf16Src widened(const float* p) {
    Bf16Src s;
    s.f = p;
    return s;
  }
  static Bf16Src both(const bf16* h, const float* f) {
    Bf16Src s;
    s.h = h;
    s.f = f;
    return s;
  }
  Bf16Src operator+(size_t off) const {
    Bf16Src s;
    if (h) s.h = h + off;
    if (f) s.f = f + off;
    return s;
  }
  explicit operator bool() const { return h || f; }
  bf16 at(size_t i) const { return h ? h[i] : to_bf16(f[i]); }  // to_bf16 is exact on bf16 values
};

enum class Bf16Path { kEmulated, kOneDnn };

// What the CPU reports that matters here, e.g. "avx2 fma" or "avx2 fma avx512f avx512_bf16".
std::string cpu_features();
bool cpu_has_avx512_bf16();
// The implementation oneDNN dispatches for a bf16 matmul on this CPU (e.g.
// "brg:avx512_core_bf16"), or empty when it has none; and oneDNN's version ("2.6.3").
std::string onednn_bf16_impl();
std::string onednn_version();
// The path in use: the one set_bf16_path chose, else auto's.
Bf16Path bf16_path();
// True when the path multiplies fp32-form operands in place (emulated): callers that can hold an
// operand in either form pick the one the path reads without conversion.
inline bool bf16_prefers_widened() { return bf16_path() == Bf16Path::kEmulated; }
// "auto" | "emulated" | "onednn" (--bf16-kernels). A usage error for another value, or for
// onednn where oneDNN has no bf16 matmul for this CPU.
Bf16Path parse_bf16_path(const std::string& v);
void set_bf16_path(Bf16Path p);  // replaces the choice for the whole process
const char* bf16_path_name(Bf16Path p);
// The line trn-train logs at start: CPU features and the kernel path.
std::string bf16_kernel_description();

// C (M,N) = beta * C + op(A) (M,K) @ op(B) (K,N), row-major; op(X) = X^T when tX. A is stored
// (M,K) with leading dimension lda, or (K,M) when ta; likewise B. beta 0 never reads C.
void gemm_bf16(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta, float* C,
               int ldc);
// What both implementations do where there is nothing to multiply: true, with C scaled by beta
// (0 never read), when M, N or K is not positive; false otherwise.
bool gemm_without_products(int M, int N, int K, float beta, float* C, int ldc);
// The two implementations (tests call them directly). gemm_bf16_onednn throws where oneDNN has
// no bf16 matmul for the CPU.
void gemm_bf16_emulated(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                        float* C, int ldc);
void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                      float* C, int ldc);
// matmul_forward_bf16 through oneDNN with the bias as its bias argument (no pass that copies it
// into out first).
void matmul_forward_bf16_onednn(float* out, Bf16Src inp, Bf16Src w, const float* bias, int N, int IC, int OC);
// The same GEMMs with bf16 arrays for A and B (tests take their address).
void gemm_bf16_emulated(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                        float beta, float* C, int ldc);
void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                      float beta, float* C, int ldc);

// The model's matmuls (same shapes as kernels.h) with bf16 operands. Outputs, biases and
// gradients are fp32. The backward rounds dout to bf16 first, so both products take bf16
// operands; db sums the fp32 dout. Two forms of that rounding, same results: into dout_h (N*OC
// bf16 values), or through bf16 into dout_r (N*OC floats, the fp32 form of the operand), which
// may be dout itself when the caller no longer needs the unrounded gradient (db is summed first).
void matmul_forward_bf16(float* out, Bf16Src inp, Bf16Src w, const float* bias, int N, int IC, int OC);
void matmul_backward_bf16(float* dinp, float* dw, float* db, const float* dout, bf16* dout_h, Bf16Src inp, Bf16Src w,
                          int N, int IC, int OC);
void matmul_backward_bf16(float* dinp, float* dw, float* db, const float* dout, float* dout_r, Bf16Src inp,
                          Bf16Src w, int N, int IC, int OC);
void lmhead_forward_bf16(float* logits, Bf16Src x, Bf16Src wte, int N, int C, int V);
void lmhead_backward_bf16(float* dx, float* dwte, const float* dlogits, bf16* dlogits_h, Bf16Src x, Bf16Src wte, int N,
                          int C, int V);
// dlogits rounded through bf16 in place (the caller's dlogits are spent after this).
void lmhead_backward_bf16(float* dx, float* dwte, float* dlogits, Bf16Src x, Bf16Src wte, int N, int C, int V);

// Element strides of a matrix in a batch: between matrices, rows and columns (one of row, col
// is 1).
struct MatStrides {
  int64_t batch, row, col;
};
// C[i] (M,N) = beta * C[i] + A[i] (M,K) @ B[i] (K,N) for i < batch, with the given strides: the
// attention products. Through oneDNN with bf16 operands, or emulated with operands held widened
// (bf16 values in fp32) through cblas_sgemm, one matrix of the batch at a time.
void batched_matmul_bf16_onednn(int batch, int M, int N, int K, const bf16* A, MatStrides sa, const bf16* B,
                                MatStrides sb, float beta, float* C, MatStrides sc);
// The same in fp32 through oneDNN (kernels.h's fp32 matmuls on AVX-512 CPUs).
void batched_matmul_f32_onednn(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B,
                               MatStrides sb, float beta, float* C, MatStrides sc);
void batched_matmul_bf16_emulated(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B,
                                  MatStrides sb, float beta, float* C, MatStrides sc);

// Causal attention under --precision bf16, blockwise (attention.cc; shapes and lse as
// kernels.h attention_forward/backward): the products take bf16 operands with fp32 sums, as
// PyTorch's autocast runs them: the scores from bf16 q and k, the softmax in fp32, and the
// probabilities, the output gradient and the scores' gradient rounded to bf16 before the products
// that take them. Both paths compute this; oneDNN multiplies the bf16 values, the emulated path
// the same values widened (qkv32: T*(H+2K)*hd floats of scratch for one sequence's q, k, v when
// qkv has no fp32 form). Per sequence, every product is batched over the KV heads. Backward takes
// the forward's output as saved (bf16) for the softmax's row terms dout . out.
void attention_forward_bf16(float* out, float* lse, Bf16Src qkv, float* qkv32, int B, int T, int H, int K, int hd);
void attention_backward_bf16(float* dqkv, const float* dout, Bf16Src qkv, float* qkv32, Bf16Src out,
                             const float* lse, int B, int T, int H, int K, int hd);

}  // namespace trn::kernels
