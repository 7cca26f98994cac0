// Fast float kernels of a Llama block: RMSNorm, rotary position embedding (HF rotate-half),
// SwiGLU and grouped-query causal attention. Each has a reference twin in llama_ref.h (same
// arguments, plain loops, templated on the element type) that the tests compare it with. Like
// kernels.h, all are single-threaded (the model runs several on disjoint slices of the batch)
// and allocate nothing.
//
// Conventions: N = B*T rows; "dX +=" accumulates, "dX =" overwrites. Fused layouts per row:
//   qkv (N, (H+2K)*hd) = [q: H heads | k: K heads | v: K heads], each head hd contiguous values;
//   gu  (N, 2F)        = [gate (F) | up (F)].
#pragma once

#include <cmath>

namespace trn::kernels {

// RoPE's frequencies: theta^(-2i/hd) for pair i, and with a scaling (Hugging Face rope_type
// "llama3", Llama-3.1 and 3.2) those of long wavelength (2 pi / frequency above original_ctx /
// low) divided by factor, those of short wavelength (below original_ctx / high) kept, and those
// between interpolated by s = (original_ctx / wavelength - low) / (high - low) as
// (1 - s) f / factor + s f. factor 0: no scaling.
struct RopeScaling {
  double factor = 0, low = 1, high = 4;
  int original_ctx = 8192;
};

inline double rope_frequency(int i, int hd, double theta, const RopeScaling& s) {
  const double f = std::pow(theta, -2.0 * i / hd);
  if (s.factor == 0) return f;
  const double pi = 3.14159265358979323846;
  const double wavelength = 2 * pi / f;
  if (wavelength < s.original_ctx / s.high) return f;
  if (wavelength > s.original_ctx / s.low) return f / s.factor;
  const double smooth = (s.original_ctx / wavelength - s.low) / (s.high - s.low);
  return (1 - smooth) * f / s.factor + smooth * f;
}

// out (N,C) = inp * rstd * weight, rstd (N) = 1 / sqrt(mean(inp^2) + eps) kept for backward.
// The sum of squares is accumulated in float (16 partial sums in a fixed order, so the result
// does not depend on the CPU's vector width), as PyTorch's fp32 mean does.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps);
// dinp (N,C) += (it is the residual stream's gradient, as in ref::layernorm_backward);
// dweight (C) +=; from dout (N,C), the forward's inp, weight and rstd.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C);

// cos, sin (seq_len, hd/2): cos/sin(t * theta^(-2i/hd)) for position t and pair i (hd even), the
// frequencies scaled as `scaling` says (rope_frequency above). Angles are computed in double
// and rounded once to float. Built once per (seq_len, hd, theta, scaling).
void rope_table(float* cos, float* sin, int seq_len, int hd, double theta, const RopeScaling& scaling = {});
// Rotates in place the first n_heads heads (hd values each) of every row of x: B*T rows of
// row_stride floats, row r at position t = r % T (T <= the table's seq_len). Head vector u:
//   u[i] <- u[i] cos - u[i+hd/2] sin,   u[i+hd/2] <- u[i+hd/2] cos + u[i] sin   (i < hd/2).
// On fused qkv rows, n_heads = H + K rotates q and k in one call and leaves v alone.
void rope_forward(float* x, int B, int T, int row_stride, int n_heads, int hd, const float* cos,
                  const float* sin);
// The transpose (= inverse) rotation, in place on the gradient rows (same layout as forward).
void rope_backward(float* dx, int B, int T, int row_stride, int n_heads, int hd, const float* cos,
                   const float* sin);

// out (N,F) = silu(gate) * up, gu (N,2F) rows [gate | up]; silu(z) = z / (1 + exp(-z)).
void swiglu_forward(float* out, const float* gu, int N, int F);
// dgu (N,2F) overwritten from dout (N,F) and the forward's gu.
void swiglu_backward(float* dgu, const float* dout, const float* gu, int N, int F);

// Grouped-query causal attention with the T x T probabilities kept: the full-matrix kernels the
// model ran before the blockwise ones (kernels.h attention_forward), kept as the comparison for
// their tests and bench (trn-attention-bench). Scale 1/sqrt(hd). qkv (B,T,(H+2K)*hd) fused rows;
// query head h reads KV head h / (H/K) in place (K divides H). out (B,T,H*hd); att (B,H,T,T)
// keeps the causal softmax for backward (entries above the diagonal are unspecified: only causal
// blocks are computed).
void attention_forward_gqa(float* out, float* att, const float* qkv, int B, int T, int H, int K,
                           int hd);
// dqkv (B,T,(H+2K)*hd) overwritten (dk, dv sum over the query heads of their group) from dout
// (B,T,H*hd) and the forward's qkv and att; scratch holds T*T floats.
void attention_backward_gqa(float* dqkv, float* scratch, const float* dout, const float* qkv,
                            const float* att, int B, int T, int H, int K, int hd);

}  // namespace trn::kernels
