// The kernels a model body calls, overloaded on the element type: float runs the fast kernels
// (runtime/kernels/kernels.h), double the reference kernels (ref.h), so a body written once runs
// as Stage<float> and as the Stage<double> the tests check against finite differences.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"
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
inline void attention_forward(float* o, float* a, const float* qkv, int B, int T, int C, int NH) {
  kernels::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_forward(double* o, double* a, const double* qkv, int B, int T, int C, int NH) {
  kernels::ref::attention_forward(o, a, qkv, B, T, C, NH);
}
inline void attention_backward(float* dqkv, float* s, const float* d, const float* qkv, const float* a, int B, int T,
                               int C, int NH) {
  kernels::attention_backward(dqkv, s, d, qkv, a, B, T, C, NH);
}
inline void attention_backward(double* dqkv, double*, const double* d, const double* qkv, const double* a, int B,
                               int T, int C, int NH) {
  kernels::ref::attention_backward(dqkv, d, qkv, a, B, T, C, NH);
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

}  // namespace ops

}  // namespace trn::model
