// Every kernel: the reference (double) backward against finite differences of its forward, and
// the fast float kernel against the reference. Float tolerance 1e-4 of the largest magnitude:
// float rounding (6e-8) grows at most with the square root of the accumulation length (< 300
// here), so a correct kernel stays near 1e-6 and a wrong index or term is off by O(1).
#include <catch2/catch.hpp>
#include <cmath>

#include "runtime/kernels/fastmath.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
namespace ref = trn::kernels::ref;

TEST_CASE("fast_exp and fast_tanh follow expf and tanhf, saturate, and give NaN for NaN") {
  for (float x = -20.0f; x <= 20.0f; x += 0.37f) {
    CHECK(kernels::fast_exp(x) == Approx(std::exp(x)).epsilon(1e-6));
    CHECK(kernels::fast_tanh(x) == Approx(std::tanh(x)).margin(1e-6));
  }
  CHECK(kernels::fast_exp(-1000.0f) < 1e-37f);
  CHECK(std::isfinite(kernels::fast_exp(1000.0f)));
  CHECK(std::isnan(kernels::fast_exp(std::nanf(""))));
  CHECK(std::isnan(kernels::fast_tanh(std::nanf(""))));
}

TEST_CASE("matmul backward matches finite differences") {
  const int N = 6, IC = 5, OC = 7;
  auto x = random_vec(N * IC, 1), w = random_vec(IC * OC, 2), b = random_vec(OC, 3);
  const auto R = random_vec(N * OC, 4);
  auto loss = [&] {
    std::vector<double> out(N * OC);
    ref::matmul_forward(out.data(), x.data(), w.data(), b.data(), N, IC, OC);
    return dot(out, R);
  };
  std::vector<double> dx(N * IC), dw(IC * OC, 0.0), db(OC, 0.0);
  ref::matmul_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), N, IC, OC);
  check_gradient("dx", x, dx, loss);
  check_gradient("dw", w, dw, loss);
  check_gradient("db", b, db, loss);
}

TEST_CASE("layernorm backward matches finite differences") {
  const int N = 4, C = 9;
  auto x = random_vec(N * C, 5), w = random_vec(C, 6), b = random_vec(C, 7);
  const auto R = random_vec(N * C, 8);
  std::vector<double> mean(N), rstd(N);
  auto loss = [&] {
    std::vector<double> out(N * C);
    ref::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return dot(out, R);
  };
  loss();
  std::vector<double> dx(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
  ref::layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(),
                          mean.data(), rstd.data(), N, C);
  check_gradient("dx", x, dx, loss);
  check_gradient("dw", w, dw, loss);
  check_gradient("db", b, db, loss);
}

TEST_CASE("gelu backward matches finite differences") {
  auto x = random_vec(50, 11, 2.0);
  const auto R = random_vec(50, 12);
  auto loss = [&] {
    std::vector<double> out(x.size());
    ref::gelu_forward(out.data(), x.data(), x.size());
    return dot(out, R);
  };
  std::vector<double> dx(x.size());
  ref::gelu_backward(dx.data(), x.data(), R.data(), x.size());
  check_gradient("dx", x, dx, loss);
}

TEST_CASE("embedding backward matches finite differences") {
  const int B = 2, T = 4, C = 3, V = 5;
  auto wte = random_vec(V * C, 13), wpe = random_vec(T * C, 14);
  const std::vector<int32_t> tok = {0, 3, 3, 1, 4, 0, 2, 3};
  const auto R = random_vec(B * T * C, 15);
  auto loss = [&] {
    std::vector<double> out(B * T * C);
    ref::encoder_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  std::vector<double> dwte(V * C, 0.0), dwpe(T * C, 0.0);
  ref::encoder_backward(dwte.data(), dwpe.data(), R.data(), tok.data(), B, T, C);
  check_gradient("dwte", wte, dwte, loss);
  check_gradient("dwpe", wpe, dwpe, loss);
}

TEST_CASE("tied LM head backward matches finite differences") {
  const int N = 4, C = 6, V = 7;
  auto x = random_vec(N * C, 16), wte = random_vec(V * C, 17);
  const auto R = random_vec(N * V, 18);
  auto loss = [&] {
    std::vector<double> out(N * V);
    ref::lmhead_forward(out.data(), x.data(), wte.data(), N, C, V);
    return dot(out, R);
  };
  std::vector<double> dx(N * C), dwte(V * C, 0.0);
  ref::lmhead_backward(dx.data(), dwte.data(), R.data(), x.data(), wte.data(), N, C, V);
  check_gradient("dx", x, dx, loss);
  check_gradient("dwte", wte, dwte, loss);
}

TEST_CASE("cross-entropy backward matches finite differences") {
  const int N = 5, V = 6;
  auto logits = random_vec(N * V, 19, 3.0);
  const std::vector<int32_t> targets = {0, 5, 2, 2, 1};
  auto loss = [&] {
    std::vector<double> p = logits, l(N);
    ref::crossentropy_forward(l.data(), p.data(), targets.data(), N, V);
    double s = 0;
    for (double v : l) s += v;
    return s;
  };
  std::vector<double> p = logits, l(N);
  ref::crossentropy_forward(l.data(), p.data(), targets.data(), N, V);
  for (int n = 0; n < N; ++n) {
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += p[n * V + v];
    CHECK(sum == Approx(1.0).epsilon(1e-12));
  }
  ref::crossentropy_backward(p.data(), targets.data(), 1.0, N, V);
  check_gradient("dlogits", logits, p, loss);
}

TEST_CASE("fast matmul and LM head match the reference") {
  const int N = 64, IC = 48, OC = 80;
  const auto x = random_vec(N * IC, 20), w = random_vec(IC * OC, 21), b = random_vec(OC, 22);
  const auto d = random_vec(N * OC, 23), dw0 = random_vec(IC * OC, 24), db0 = random_vec(OC, 25);
  for (bool with_bias : {true, false}) {
    std::vector<double> out(N * OC);
    ref::matmul_forward(out.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, N, IC, OC);
    auto xf = to_float(x), wf = to_float(w), bf = to_float(b);
    std::vector<float> outf(N * OC);
    kernels::matmul_forward(outf.data(), xf.data(), wf.data(), with_bias ? bf.data() : nullptr, N,
                            IC, OC);
    CHECK(max_rel_diff(outf, out) < 1e-4);
  }
  std::vector<double> dx(N * IC), dw = dw0, db = db0;
  ref::matmul_backward(dx.data(), dw.data(), db.data(), d.data(), x.data(), w.data(), N, IC, OC);
  auto xf = to_float(x), wf = to_float(w), df = to_float(d), dwf = to_float(dw0),
       dbf = to_float(db0);
  std::vector<float> dxf(N * IC, 123.0f);  // overwritten, not accumulated
  kernels::matmul_backward(dxf.data(), dwf.data(), dbf.data(), df.data(), xf.data(), wf.data(), N,
                           IC, OC);
  CHECK(max_rel_diff(dxf, dx) < 1e-4);
  CHECK(max_rel_diff(dwf, dw) < 1e-4);
  CHECK(max_rel_diff(dbf, db) < 1e-4);

  const int C = 32, V = 70;
  const auto h = random_vec(N * C, 26), wte = random_vec(V * C, 27), dl = random_vec(N * V, 28);
  std::vector<double> logits(N * V), dh(N * C), dwte(V * C, 0.5);
  ref::lmhead_forward(logits.data(), h.data(), wte.data(), N, C, V);
  ref::lmhead_backward(dh.data(), dwte.data(), dl.data(), h.data(), wte.data(), N, C, V);
  auto hf = to_float(h), wtef = to_float(wte), dlf = to_float(dl);
  std::vector<float> logitsf(N * V), dhf(N * C), dwtef(V * C, 0.5f);
  kernels::lmhead_forward(logitsf.data(), hf.data(), wtef.data(), N, C, V);
  kernels::lmhead_backward(dhf.data(), dwtef.data(), dlf.data(), hf.data(), wtef.data(), N, C, V);
  CHECK(max_rel_diff(logitsf, logits) < 1e-4);
  CHECK(max_rel_diff(dhf, dh) < 1e-4);
  CHECK(max_rel_diff(dwtef, dwte) < 1e-4);
}

TEST_CASE("fast gelu and cross-entropy match the reference") {
  const size_t n = 4096;
  auto x = random_vec(n, 31, 3.0);
  x[0] = 0.0;
  x[1] = 40.0;
  x[2] = -40.0;
  const auto d = random_vec(n, 32);
  std::vector<double> y(n), dx(n);
  ref::gelu_forward(y.data(), x.data(), n);
  ref::gelu_backward(dx.data(), x.data(), d.data(), n);
  auto xf = to_float(x), df = to_float(d);
  std::vector<float> yf(n), dxf(n);
  kernels::gelu_forward(yf.data(), xf.data(), n);
  kernels::gelu_backward(dxf.data(), xf.data(), df.data(), n);
  CHECK(max_rel_diff(yf, y) < 1e-5);
  CHECK(max_rel_diff(dxf, dx) < 1e-5);

  const int N = 16, V = 300;
  auto logits = random_vec(N * V, 33, 4.0);
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; ++i) targets[i] = (i * 37) % V;
  std::vector<double> p = logits, l(N);
  ref::crossentropy_forward(l.data(), p.data(), targets.data(), N, V);
  auto pf = to_float(logits);
  std::vector<float> lf(N);
  kernels::crossentropy_forward(lf.data(), pf.data(), targets.data(), N, V);
  CHECK(max_rel_diff(lf, l) < 1e-5);
  CHECK(max_rel_diff(pf, p) < 1e-6);
}

TEST_CASE("oneDNN's fp32 GEMM equals the double product for every transpose, beta and bias (where it runs)") {
  if (kernels::onednn_f32_impl().empty()) {
    WARN("SKIPPED: oneDNN has no fp32 matmul here");
    return;
  }
  INFO("oneDNN fp32: " << kernels::onednn_f32_impl());
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int mode = 0; mode < 3; ++mode) {  // beta 0, beta 1, beta 0 with a bias
        const int M = 70, N = 45, K = 33, lda = (ta ? M : K) + 2, ldb = (tb ? K : N) + 1, ldc = N + 3;
        INFO("ta " << ta << " tb " << tb << " mode " << mode);
        const auto A = random_vec(size_t(ta ? K : M) * lda, 60), B = random_vec(size_t(tb ? N : K) * ldb, 61);
        const auto C0 = random_vec(size_t(M) * ldc, 62), bias = random_vec(N, 63);
        const float beta = mode == 1 ? 1.0f : 0.0f;
        std::vector<double> want(size_t(M) * N);
        for (int m = 0; m < M; ++m)
          for (int n = 0; n < N; ++n) {
            double s = mode == 1 ? double(float(C0[size_t(m) * ldc + n])) : mode == 2 ? double(float(bias[n])) : 0.0;
            for (int k = 0; k < K; ++k)
              s += double(float(ta ? A[size_t(k) * lda + m] : A[size_t(m) * lda + k])) *
                   double(float(tb ? B[size_t(n) * ldb + k] : B[size_t(k) * ldb + n]));
            want[size_t(m) * N + n] = s;
          }
        const auto Af = to_float(A), Bf = to_float(B), biasf = to_float(bias);
        auto Cf = to_float(C0);
        kernels::gemm_f32_onednn(ta, tb, M, N, K, Af.data(), lda, Bf.data(), ldb, beta, Cf.data(), ldc,
                                 mode == 2 ? biasf.data() : nullptr);
        std::vector<float> got(size_t(M) * N);
        bool pads_kept = true;
        for (int m = 0; m < M; ++m) {
          for (int n = 0; n < N; ++n) got[size_t(m) * N + n] = Cf[size_t(m) * ldc + n];
          for (int n = N; n < ldc; ++n) pads_kept = pads_kept && Cf[size_t(m) * ldc + n] == float(C0[size_t(m) * ldc + n]);
        }
        CHECK(max_rel_diff(got, want) < 1e-5);
        CHECK(pads_kept);
      }
}
