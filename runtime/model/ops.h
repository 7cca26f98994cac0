// The kernels a model body calls, overloaded on the element type: float runs the fast kernels
// (runtime/kernels/kernels.h), double the reference kernels (ref.h), so a body written once runs
// as Stage<float> and as the Stage<double> the tests check against finite differences.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/kernels/llama_ref.h"
#include "runtime/kernels/ref.h"

namespace trn::model {
namespace ops {

// float: the fast kernels; double: the reference kernels.
inline void matmul_forward(float* o, const float* x, const float* w, const float* b, int N, int I, int O) {
  kernels::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_forward(double* o, const double* x, const double* w, const double* b, int N, int I, int O) {
  kernels::ref::matmul_forward(o, x, w, b, N, I, O);
}
inline void matmul_backward(float* dx, float* dw, float* db, const float* d, const float* x, const float* w, int N,
                            int I, int O) {
  kernels::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void matmul_backward(double* dx, double* dw, double* db, const double* d, const double* x, const double* w,
                            int N, int I, int O) {
  kernels::ref::matmul_backward(dx, dw, db, d, x, w, N, I, O);
}
inline void lmhead_forward(float* l, const float* x, const float* w, int N, int C, int V) {
  kernels::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_forward(double* l, const double* x, const double* w, int N, int C, int V) {
  kernels::ref::lmhead_forward(l, x, w, N, C, V);
}
inline void lmhead_backward(float* dx, float* dw, const float* dl, const float* x, const float* w, int N, int C,
                            int V) {
  kernels::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void lmhead_backward(double* dx, double* dw, const double* dl, const double* x, const double* w, int N,
                            int C, int V) {
  kernels::ref::lmhead_backward(dx, dw, dl, x, w, N, C, V);
}
inline void attention_forward(float* o, float* lse, const float* qkv, int B, int T, int H, int K, int hd) {
  kernels::attention_forward(o, lse, qkv, B, T, H, K, hd);
}
inline void attention_forward(double* o, double* lse, const double* qkv, int B, int T, int H, int K, int hd) {
  kernels::ref::attention_forward(o, lse, qkv, B, T, H, K, hd);
}
inline void attention_backward(float* dqkv, const float* d, const float* qkv, const float* o, const float* lse, int B,
                               int T, int H, int K, int hd) {
  kernels::attention_backward(dqkv, d, qkv, o, lse, B, T, H, K, hd);
}
inline void attention_backward(double* dqkv, const double* d, const double* qkv, const double* o, const double* lse,
                               int B, int T, int H, int K, int hd) {
  kernels::ref::attention_backward(dqkv, d, qkv, o, lse, B, T, H, K, hd);
}
inline void gelu_forward(float* o, const float* x, size_t N) { kernels::gelu_forward(o, x, N); }
inline void gelu_forward(double* o, const double* x, size_t N) { kernels::ref::gelu_forward(o, x, N); }
inline void gelu_backward(float* dx, const float* x, const float* d, size_t N) { kernels::gelu_backward(dx, x, d, N); }
inline void gelu_backward(double* dx, const double* x, const double* d, size_t N) {
  kernels::ref::gelu_backward(dx, x, d, N);
}
inline void crossentropy_forward(float* l, float* p, const int32_t* t, int N, int V) {
  kernels::crossentropy_forward(l, p, t, N, V);
}
inline void crossentropy_forward(double* l, double* p, const int32_t* t, int N, int V) {
  kernels::ref::crossentropy_forward(l, p, t, N, V);
}
inline float exp_of(float x) { return kernels::fast_exp(x); }
inline double exp_of(double x) { return std::exp(x); }

// out[i] += bias[i % C] for out (N,C): the bias of a row-parallel layer, added after its
// all-reduce so that it counts once.
template <typename T>
void add_bias(T* out, const T* bias, int N, int C) {
  for (int n = 0; n < N; ++n) {
    T* o = out + size_t(n) * C;
    for (int i = 0; i < C; ++i) o[i] += bias[i];
  }
}

inline void linear_forward(float* o, const float* x, const float* w, int N, int I, int O) {
  kernels::linear_forward(o, x, w, N, I, O);
}
inline void linear_forward(double* o, const double* x, const double* w, int N, int I, int O) {
  kernels::ref::linear_forward(o, x, w, N, I, O);
}
inline void linear_backward(float* dx, float* dw, const float* d, const float* x, const float* w, int N, int I, int O) {
  kernels::linear_backward(dx, dw, d, x, w, N, I, O);
}
inline void linear_backward(double* dx, double* dw, const double* d, const double* x, const double* w, int N, int I,
                            int O) {
  kernels::ref::linear_backward(dx, dw, d, x, w, N, I, O);
}
inline void rmsnorm_forward(float* o, float* rstd, const float* x, const float* w, int N, int C, float eps) {
  kernels::rmsnorm_forward(o, rstd, x, w, N, C, eps);
}
inline void rmsnorm_forward(double* o, double* rstd, const double* x, const double* w, int N, int C, float eps) {
  kernels::ref::rmsnorm_forward(o, rstd, x, w, N, C, eps);
}
inline void rmsnorm_backward(float* dx, float* dw, const float* d, const float* x, const float* w, const float* rstd,
                             int N, int C) {
  kernels::rmsnorm_backward(dx, dw, d, x, w, rstd, N, C);
}
inline void rmsnorm_backward(double* dx, double* dw, const double* d, const double* x, const double* w,
                             const double* rstd, int N, int C) {
  kernels::ref::rmsnorm_backward(dx, dw, d, x, w, rstd, N, C);
}
inline void rope_table(float* c, float* s, int T, int hd, double theta, const kernels::RopeScaling& scaling) {
  kernels::rope_table(c, s, T, hd, theta, scaling);
}
inline void rope_table(double* c, double* s, int T, int hd, double theta, const kernels::RopeScaling& scaling) {
  kernels::ref::rope_table(c, s, T, hd, theta, scaling);
}
inline void rope_forward(float* x, int B, int T, int stride, int heads, int hd, const float* c, const float* s) {
  kernels::rope_forward(x, B, T, stride, heads, hd, c, s);
}
inline void rope_forward(double* x, int B, int T, int stride, int heads, int hd, const double* c, const double* s) {
  kernels::ref::rope_forward(x, B, T, stride, heads, hd, c, s);
}
inline void rope_backward(float* x, int B, int T, int stride, int heads, int hd, const float* c, const float* s) {
  kernels::rope_backward(x, B, T, stride, heads, hd, c, s);
}
inline void rope_backward(double* x, int B, int T, int stride, int heads, int hd, const double* c, const double* s) {
  kernels::ref::rope_backward(x, B, T, stride, heads, hd, c, s);
}
inline void swiglu_forward(float* o, const float* gu, int N, int F) { kernels::swiglu_forward(o, gu, N, F); }
inline void swiglu_forward(double* o, const double* gu, int N, int F) { kernels::ref::swiglu_forward(o, gu, N, F); }
inline void swiglu_backward(float* dgu, const float* d, const float* gu, int N, int F) {
  kernels::swiglu_backward(dgu, d, gu, N, F);
}
inline void swiglu_backward(double* dgu, const double* d, const double* gu, int N, int F) {
  kernels::ref::swiglu_backward(dgu, d, gu, N, F);
}

}  // namespace ops

}  // namespace trn::model
