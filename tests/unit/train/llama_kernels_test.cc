// The Llama block's kernels (llama.h, llama_ref.h): every reference (double) backward against
// finite differences of its forward, the fast float kernels against the reference in double,
// and the properties the model relies on (RoPE is a rotation and the identity at position 0,
// RMSNorm gives unit RMS). The full-matrix GQA kernels tested here are the comparison for the
// blockwise ones (attention_test.cc).
// Float tolerance 1e-5 of the largest magnitude: float rounding (6e-8) grows with the square
// root of the accumulation lengths here (< 1000), whatever order BLAS sums in, so a correct
// kernel stays well below it and a wrong index or term is off by O(1).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/kernels/llama_ref.h"
#include "runtime/kernels/ref.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
namespace ref = trn::kernels::ref;

namespace {

constexpr float kEps = 1e-5f;

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0.0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

double max_rel_diff_ff(const std::vector<float>& a, const std::vector<float>& b) {
  return max_rel_diff(a, std::vector<double>(b.begin(), b.end()));
}

}  // namespace

TEST_CASE("rmsnorm backward matches finite differences") {
  const int N = 4, C = 9;
  auto x = random_vec(N * C, 101), w = random_vec(C, 102);
  const auto R = random_vec(N * C, 103);
  std::vector<double> rstd(N);
  auto loss = [&] {
    std::vector<double> out(N * C);
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    return dot(out, R);
  };
  loss();
  std::vector<double> dx(N * C, 0.0), dw(C, 0.0);
  ref::rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  check_gradient("dx", x, dx, loss);
  check_gradient("dw", w, dw, loss);
}

TEST_CASE("rmsnorm output has unit RMS before the weight") {
  const int N = 8, C = 64;
  for (double scale : {0.3, 1.0, 7.0}) {
    const auto x = random_vec(N * C, 104, scale);
    const std::vector<double> w(C, 1.0);
    std::vector<double> out(N * C), rstd(N);
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    auto xf = to_float(x), wf = to_float(w);
    std::vector<float> outf(N * C), rstdf(N);
    kernels::rmsnorm_forward(outf.data(), rstdf.data(), xf.data(), wf.data(), N, C, kEps);
    for (int n = 0; n < N; ++n) {
      double ms = 0.0, ms_out = 0.0, ms_outf = 0.0;
      for (int i = 0; i < C; ++i) {
        ms += x[n * C + i] * x[n * C + i];
        ms_out += out[n * C + i] * out[n * C + i];
        ms_outf += double(outf[n * C + i]) * outf[n * C + i];
      }
      ms /= C;
      const double expected = std::sqrt(ms / (ms + double(kEps)));  // 1 up to the eps
      INFO("scale " << scale << " row " << n);
      CHECK(std::abs(expected - 1.0) < 1e-3);
      CHECK(std::abs(std::sqrt(ms_out / C) - expected) < 1e-12);
      CHECK(std::abs(std::sqrt(ms_outf / C) - expected) < 1e-6);
      CHECK(std::abs(rstd[n] * std::sqrt(ms + double(kEps)) - 1.0) < 1e-12);
    }
  }
}

TEST_CASE("fast rmsnorm matches the reference") {
  for (int C : {37, 256}) {  // 37: not a multiple of the kernel's vector lanes
    const int N = 32;
    const auto x = random_vec(N * C, 105 + C, 2.0), w = random_vec(C, 106 + C),
               d = random_vec(N * C, 107 + C), dx0 = random_vec(N * C, 108 + C),
               dw0 = random_vec(C, 109 + C);
    std::vector<double> out(N * C), rstd(N), dx = dx0, dw = dw0;  // the gradients accumulate
    ref::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    ref::rmsnorm_backward(dx.data(), dw.data(), d.data(), x.data(), w.data(), rstd.data(), N, C);
    auto xf = to_float(x), wf = to_float(w), df = to_float(d), dxf = to_float(dx0),
         dwf = to_float(dw0);
    std::vector<float> outf(N * C), rstdf(N);
    kernels::rmsnorm_forward(outf.data(), rstdf.data(), xf.data(), wf.data(), N, C, kEps);
    kernels::rmsnorm_backward(dxf.data(), dwf.data(), df.data(), xf.data(), wf.data(), rstdf.data(),
                              N, C);
    INFO("C = " << C);
    CHECK(max_rel_diff(outf, out) < 1e-5);
    CHECK(max_rel_diff(rstdf, rstd) < 1e-5);
    CHECK(max_rel_diff(dxf, dx) < 1e-5);
    CHECK(max_rel_diff(dwf, dw) < 1e-5);
  }
}

TEST_CASE("rope follows the rotate-half convention") {
  // Fused qkv rows of H + 2K heads; rotating n_heads = H + K heads leaves v untouched.
  const int B = 2, T = 6, H = 2, K = 1, hd = 8, half = hd / 2, stride = (H + 2 * K) * hd;
  const int seq_len = 16;  // the table is built for the longest sequence, used for shorter ones
  const double theta = 10000.0;
  std::vector<double> cos_t(seq_len * half), sin_t(seq_len * half);
  ref::rope_table(cos_t.data(), sin_t.data(), seq_len, hd, theta);
  const auto x = random_vec(B * T * stride, 110);
  auto y = x;
  ref::rope_forward(y.data(), B, T, stride, H + K, hd, cos_t.data(), sin_t.data());
  for (int r = 0; r < B * T; ++r) {
    const int t = r % T;
    for (int h = 0; h < H + 2 * K; ++h)
      for (int i = 0; i < half; ++i) {
        const size_t lo = size_t(r) * stride + h * hd + i, hi = lo + half;
        INFO("row " << r << " head " << h << " pair " << i);
        if (h >= H + K || t == 0) {  // v heads, and every head at position 0: unchanged
          CHECK(y[lo] == x[lo]);
          CHECK(y[hi] == x[hi]);
          continue;
        }
        const double angle = t * std::pow(theta, -2.0 * i / hd);
        CHECK(std::abs(y[lo] - (x[lo] * std::cos(angle) - x[hi] * std::sin(angle))) < 1e-12);
        CHECK(std::abs(y[hi] - (x[hi] * std::cos(angle) + x[lo] * std::sin(angle))) < 1e-12);
      }
  }

  // The fast kernel: the same rotation, and position 0 is exactly the identity.
  std::vector<float> cos_f(seq_len * half), sin_f(seq_len * half);
  kernels::rope_table(cos_f.data(), sin_f.data(), seq_len, hd, theta);
  CHECK(max_rel_diff(cos_f, cos_t) < 1e-7);
  CHECK(max_rel_diff(sin_f, sin_t) < 1e-7);
  auto xf = to_float(x), yf = xf;
  kernels::rope_forward(yf.data(), B, T, stride, H + K, hd, cos_f.data(), sin_f.data());
  CHECK(max_rel_diff(yf, y) < 1e-6);
  for (int r = 0; r < B * T; r += T)
    for (int i = 0; i < stride; ++i) CHECK(yf[size_t(r) * stride + i] == xf[size_t(r) * stride + i]);
  for (int r = 0; r < B * T; ++r)
    for (int i = (H + K) * hd; i < stride; ++i)
      CHECK(yf[size_t(r) * stride + i] == xf[size_t(r) * stride + i]);
}

TEST_CASE("rope backward is the inverse rotation and matches finite differences") {
  const int B = 2, T = 5, H = 4, K = 2, hd = 6, half = hd / 2, stride = (H + 2 * K) * hd;
  const double theta = 500000.0;
  std::vector<double> cos_t(T * half), sin_t(T * half);
  ref::rope_table(cos_t.data(), sin_t.data(), T, hd, theta);
  auto x = random_vec(B * T * stride, 111);
  const auto R = random_vec(B * T * stride, 112);
  auto loss = [&] {
    auto y = x;
    ref::rope_forward(y.data(), B, T, stride, H + K, hd, cos_t.data(), sin_t.data());
    return dot(y, R);
  };
  auto dx = R;
  ref::rope_backward(dx.data(), B, T, stride, H + K, hd, cos_t.data(), sin_t.data());
  check_gradient("dx", x, dx, loss);

  // forward then backward gives back the input: the rotation is orthogonal
  auto y = x;
  ref::rope_forward(y.data(), B, T, stride, H + K, hd, cos_t.data(), sin_t.data());
  ref::rope_backward(y.data(), B, T, stride, H + K, hd, cos_t.data(), sin_t.data());
  CHECK(max_abs_diff(y, x) < 1e-12);

  std::vector<float> cos_f(T * half), sin_f(T * half);
  kernels::rope_table(cos_f.data(), sin_f.data(), T, hd, theta);
  auto xf = to_float(x), yf = xf, Rf = to_float(R);
  kernels::rope_forward(yf.data(), B, T, stride, H + K, hd, cos_f.data(), sin_f.data());
  kernels::rope_backward(yf.data(), B, T, stride, H + K, hd, cos_f.data(), sin_f.data());
  CHECK(max_rel_diff_ff(yf, xf) < 1e-6);
  kernels::rope_backward(Rf.data(), B, T, stride, H + K, hd, cos_f.data(), sin_f.data());
  CHECK(max_rel_diff(Rf, dx) < 1e-6);
}

TEST_CASE("swiglu backward matches finite differences") {
  const int N = 3, F = 7;
  auto gu = random_vec(N * 2 * F, 113, 2.0);
  const auto R = random_vec(N * F, 114);
  auto loss = [&] {
    std::vector<double> out(N * F);
    ref::swiglu_forward(out.data(), gu.data(), N, F);
    return dot(out, R);
  };
  std::vector<double> dgu(gu.size(), 5.0);  // overwritten
  ref::swiglu_backward(dgu.data(), R.data(), gu.data(), N, F);
  check_gradient("dgu", gu, dgu, loss);
}

TEST_CASE("fast swiglu matches the reference") {
  const int N = 16, F = 200;
  auto gu = random_vec(N * 2 * F, 115, 3.0);
  gu[0] = 0.0;
  gu[1] = 40.0;
  gu[2] = -40.0;
  gu[3] = -100.0;
  const auto d = random_vec(N * F, 116);
  std::vector<double> out(N * F), dgu(gu.size());
  ref::swiglu_forward(out.data(), gu.data(), N, F);
  ref::swiglu_backward(dgu.data(), d.data(), gu.data(), N, F);
  auto guf = to_float(gu), df = to_float(d);
  std::vector<float> outf(N * F), dguf(gu.size(), 9.0f);
  kernels::swiglu_forward(outf.data(), guf.data(), N, F);
  kernels::swiglu_backward(dguf.data(), df.data(), guf.data(), N, F);
  CHECK(max_rel_diff(outf, out) < 1e-5);
  CHECK(max_rel_diff(dguf, dgu) < 1e-5);
  for (float v : outf) CHECK(std::isfinite(v));
  for (float v : dguf) CHECK(std::isfinite(v));
}

TEST_CASE("gqa attention backward matches finite differences") {
  const int B = 2, T = 5, H = 4, hd = 3;
  for (int K : {1, 2, 4}) {
    const int R = (H + 2 * K) * hd;
    auto qkv = random_vec(B * T * R, 117 + K);
    const auto D = random_vec(B * T * H * hd, 118 + K);
    std::vector<double> att(B * H * T * T);
    auto loss = [&] {
      std::vector<double> out(B * T * H * hd);
      ref::attention_forward_gqa(out.data(), att.data(), qkv.data(), B, T, H, K, hd);
      return dot(out, D);
    };
    loss();
    std::vector<double> dqkv(qkv.size(), 3.0);
    ref::attention_backward_gqa(dqkv.data(), static_cast<double*>(nullptr), D.data(), qkv.data(),
                                att.data(), B, T, H, K, hd);
    INFO("K = " << K);
    check_gradient("dqkv", qkv, dqkv, loss);
  }
}

TEST_CASE("fast gqa attention matches the reference") {
  const int B = 2, H = 4, hd = 16;
  for (int K : {1, 2, 4})
    for (int T : {1, 7, 64, 65, 150}) {
      const int R = (H + 2 * K) * hd;
      const auto qkv = random_vec(B * T * R, 123 + 10 * K + T),
                 d = random_vec(B * T * H * hd, 124 + 10 * K + T);
      std::vector<double> out(B * T * H * hd), att(B * H * T * T), dqkv(qkv.size());
      ref::attention_forward_gqa(out.data(), att.data(), qkv.data(), B, T, H, K, hd);
      ref::attention_backward_gqa(dqkv.data(), static_cast<double*>(nullptr), d.data(), qkv.data(),
                                  att.data(), B, T, H, K, hd);
      auto qkvf = to_float(qkv), df = to_float(d);
      std::vector<float> outf(out.size()), attf(att.size()), dqkvf(qkv.size(), 7.0f),
          scratch(T * T);
      kernels::attention_forward_gqa(outf.data(), attf.data(), qkvf.data(), B, T, H, K, hd);
      kernels::attention_backward_gqa(dqkvf.data(), scratch.data(), df.data(), qkvf.data(),
                                      attf.data(), B, T, H, K, hd);
      INFO("K = " << K << " T = " << T);
      CHECK(max_rel_diff(outf, out) < 1e-5);
      for (size_t row = 0; row < size_t(B * H * T); ++row)  // above the diagonal: unspecified
        for (int u = int(row % T) + 1; u < T; ++u) attf[row * T + u] = float(att[row * T + u]);
      CHECK(max_rel_diff(attf, att) < 1e-5);
      CHECK(max_rel_diff(dqkvf, dqkv) < 1e-5);
    }
}
