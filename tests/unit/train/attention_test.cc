// The blockwise causal attention (kernels.h attention_forward/backward, bf16.h *_bf16) and its
// reference twin (ref.h): the twin's backward against finite differences and against the
// full-matrix reference (llama_ref.h); the fp32 kernel against the twin in double and against the
// full-matrix float kernel it replaced; causality, B, the heads a rank holds; the bf16 kernel
// against its rounding scheme written out in double, on both paths.
//
// Shapes: T runs over 1, block edges (127..129, 255..257) and lengths that end inside a block
// (7, 64, 150, 300), so the diagonal block, partial blocks and several key blocks per query block
// (kAttentionRows = kAttentionKeys = 128) are all met; K < H (1, 2) and K == H (GPT-2's layout).
// Float tolerance 1e-5 of the largest magnitude, as for the other fast kernels: fp32 rounding
// grows with the square root of the sums' lengths (< 400 here), so a correct kernel stays far
// below it and a wrong index, a skipped block or a lost rescale is off by O(1e-2) or more.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/kernels/llama.h"
#include "runtime/kernels/llama_ref.h"
#include "runtime/kernels/ref.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
using kernels::bf16;
namespace ref = trn::kernels::ref;

namespace {

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0.0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

struct Shape {
  int B, T, H, K, hd;
  int R() const { return (H + 2 * K) * hd; }
  size_t qkv() const { return size_t(B) * T * R(); }
  size_t out() const { return size_t(B) * T * H * hd; }
  size_t lse() const { return size_t(B) * H * T; }
};

// The fp32 kernel's forward and backward.
struct Fp32Run {
  std::vector<float> out, lse, dqkv;
};
Fp32Run run_fp32(const Shape& s, const std::vector<float>& qkv, const std::vector<float>& d) {
  Fp32Run r{std::vector<float>(s.out()), std::vector<float>(s.lse()), std::vector<float>(s.qkv(), 7.0f)};
  kernels::attention_forward(r.out.data(), r.lse.data(), qkv.data(), s.B, s.T, s.H, s.K, s.hd);
  kernels::attention_backward(r.dqkv.data(), d.data(), qkv.data(), r.out.data(), r.lse.data(), s.B, s.T, s.H,
                              s.K, s.hd);
  return r;
}

}  // namespace

TEST_CASE("blockwise attention's reference twin: backward matches finite differences") {
  const int B = 2, T = 5, H = 4, hd = 3;
  for (int K : {1, 2, 4}) {
    const Shape s{B, T, H, K, hd};
    auto qkv = random_vec(s.qkv(), 201 + K);
    const auto D = random_vec(s.out(), 202 + K);
    std::vector<double> out(s.out()), lse(s.lse());
    auto loss = [&] {
      ref::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, K, hd);
      return dot(out, D);
    };
    loss();
    std::vector<double> dqkv(qkv.size(), 3.0);
    ref::attention_backward(dqkv.data(), D.data(), qkv.data(), out.data(), lse.data(), B, T, H, K, hd);
    INFO("K = " << K);
    check_gradient("dqkv", qkv, dqkv, loss);
  }
}

TEST_CASE(
    "blockwise attention's reference twin equals the full-matrix reference; lse is the row's log-sum-exp") {
  const int B = 2, T = 9, H = 4, hd = 5;
  for (int K : {1, 2, 4}) {
    const Shape s{B, T, H, K, hd};
    const auto qkv = random_vec(s.qkv(), 211 + K), d = random_vec(s.out(), 212 + K);
    std::vector<double> out(s.out()), lse(s.lse()), dqkv(s.qkv());
    ref::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, K, hd);
    ref::attention_backward(dqkv.data(), d.data(), qkv.data(), out.data(), lse.data(), B, T, H, K, hd);
    std::vector<double> out2(s.out()), att(size_t(B) * H * T * T), dqkv2(s.qkv());
    ref::attention_forward_gqa(out2.data(), att.data(), qkv.data(), B, T, H, K, hd);
    ref::attention_backward_gqa(dqkv2.data(), static_cast<double*>(nullptr), d.data(), qkv.data(), att.data(),
                                B, T, H, K, hd);
    INFO("K = " << K);
    CHECK(max_abs_diff(out, out2) < 1e-12);
    CHECK(max_abs_diff(dqkv, dqkv2) < 1e-12);
    // p = exp(s - lse) is the full-matrix softmax: the first key's probability gives lse back.
    const double scale = 1.0 / std::sqrt(double(hd));
    double worst = 0.0;
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) {
          double s0 = 0.0;
          for (int i = 0; i < hd; ++i)
            s0 += qkv[(size_t(b) * T + t) * s.R() + h * hd + i] *
                  qkv[size_t(b) * T * s.R() + (H + h / (H / K)) * hd + i];
          const double p0 = att[((size_t(b) * H + h) * T + t) * T];
          worst = std::max(worst, std::abs(std::exp(s0 * scale - lse[(size_t(b) * H + h) * T + t]) - p0));
        }
    CHECK(worst < 1e-12);
  }
}

// Measured max_rel_diff of the fp32 kernel against the twin in double, worst over these shapes:
// out 3.1e-7, dqkv 7.6e-7, lse 1.2e-7 (AVX-512, oneDNN products); 2.9e-7, 3.1e-7, 1.7e-7 with
// cblas_sgemm's (the AVX2 path).
TEST_CASE(
    "blockwise attention in fp32 matches its reference twin, causal blocks and partial blocks included") {
  const int B = 2, H = 4, hd = 16;
  // Both product paths on any CPU: oneDNN where it runs (AVX-512), and cblas_sgemm.
  const bool blas = GENERATE(false, true);
  kernels::set_attention_blas(blas);
  INFO("cblas products " << blas);
  for (int K : {1, 2, 4})
    for (int T : {1, 7, 64, 127, 128, 129, 150, 255, 256, 257, 300}) {
      const Shape s{B, T, H, K, hd};
      const auto qkv = random_vec(s.qkv(), 221 + 10 * K + T), d = random_vec(s.out(), 222 + 10 * K + T);
      std::vector<double> out(s.out()), lse(s.lse()), dqkv(s.qkv());
      ref::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, K, hd);
      ref::attention_backward(dqkv.data(), d.data(), qkv.data(), out.data(), lse.data(), B, T, H, K, hd);
      const Fp32Run r = run_fp32(s, to_float(qkv), to_float(d));
      INFO("K = " << K << " T = " << T);
      CHECK(max_rel_diff(r.out, out) < 1e-5);
      CHECK(max_rel_diff(r.lse, lse) < 1e-5);
      CHECK(max_rel_diff(r.dqkv, dqkv) < 1e-5);
    }
  kernels::set_attention_blas(false);
}

// Measured max_rel_diff against the full-matrix kernel, both in float, worst over these shapes:
// out 2.5e-7, dqkv 5.0e-7 (AVX-512; 2.5e-7 and 5.8e-7 with cblas_sgemm products). The two differ
// only in the order of fp32 sums and where the softmax normalises.
TEST_CASE("blockwise attention in fp32 matches the full-matrix kernel it replaced") {
  const int B = 2, H = 4, hd = 32;
  for (int K : {2, 4})
    for (int T : {65, 300}) {
      const Shape s{B, T, H, K, hd};
      const auto qkv = to_float(random_vec(s.qkv(), 231 + K + T)),
                 d = to_float(random_vec(s.out(), 232 + K + T));
      const Fp32Run r = run_fp32(s, qkv, d);
      std::vector<float> out(s.out()), att(size_t(B) * H * T * T), dqkv(s.qkv()), scratch(size_t(T) * T);
      kernels::attention_forward_gqa(out.data(), att.data(), qkv.data(), B, T, H, K, hd);
      kernels::attention_backward_gqa(dqkv.data(), scratch.data(), d.data(), qkv.data(), att.data(), B, T, H,
                                      K, hd);
      const double dout = max_rel_diff(r.out, std::vector<double>(out.begin(), out.end()));
      const double dd = max_rel_diff(r.dqkv, std::vector<double>(dqkv.begin(), dqkv.end()));
      INFO("K = " << K << " T = " << T);
      CHECK(dout < 1e-5);
      CHECK(dd < 1e-5);
    }
}

TEST_CASE("blockwise attention is causal: later tokens change neither earlier outputs nor their gradients") {
  const Shape s{1, 200, 4, 2, 16};
  auto qkv = to_float(random_vec(s.qkv(), 241));
  auto d = to_float(random_vec(s.out(), 242));
  const Fp32Run a = run_fp32(s, qkv, d);
  const int t0 = 130;  // inside the second key block
  for (size_t i = size_t(t0) * s.R(); i < qkv.size(); ++i) qkv[i] += 0.5f;
  // The output gradient of the later rows is zeroed, so the earlier rows' gradients see no
  // later query: dk, dv of keys < t0 come from queries < t0 only.
  for (size_t i = size_t(t0) * s.H * s.hd; i < d.size(); ++i) d[i] = 0.0f;
  const Fp32Run b = run_fp32(s, qkv, d);
  for (int t = 0; t < t0; ++t)
    for (int c = 0; c < s.H * s.hd; ++c)
      REQUIRE(a.out[size_t(t) * s.H * s.hd + c] == b.out[size_t(t) * s.H * s.hd + c]);
  for (int t = 0; t < t0; ++t)
    for (int h = 0; h < s.H; ++h) REQUIRE(a.lse[size_t(h) * s.T + t] == b.lse[size_t(h) * s.T + t]);
  // The gradient of the earlier rows, rerun with the zeroed gradient on the unchanged input.
  const Fp32Run c = run_fp32(s, to_float(random_vec(s.qkv(), 241)), d);
  for (size_t i = 0; i < size_t(t0) * s.R(); ++i) REQUIRE(b.dqkv[i] == c.dqkv[i]);
}

namespace {

// Sequence b's rows of heads [h0, h0 + nh) and their KV heads [h0 / g, (h0 + nh) / g) out of a
// (B,T,(H+2K)hd) buffer: the q, k, v a tensor-parallel rank holding those heads computes on.
std::vector<float> slice_qkv(const std::vector<float>& qkv, const Shape& s, int b, int h0, int nh) {
  const int g = s.H / s.K, k0 = h0 / g, nk = nh / g, R = s.R();
  std::vector<float> out;
  for (int t = 0; t < s.T; ++t) {
    const float* row = qkv.data() + (size_t(b) * s.T + t) * R;
    out.insert(out.end(), row + h0 * s.hd, row + (h0 + nh) * s.hd);
    out.insert(out.end(), row + (s.H + k0) * s.hd, row + (s.H + k0 + nk) * s.hd);
    out.insert(out.end(), row + (s.H + s.K + k0) * s.hd, row + (s.H + s.K + k0 + nk) * s.hd);
  }
  return out;
}
std::vector<float> slice_rows(const std::vector<float>& x, int T, int width, int b, int c0, int n) {
  std::vector<float> out;
  for (int t = 0; t < T; ++t) {
    const float* row = x.data() + (size_t(b) * T + t) * width;
    out.insert(out.end(), row + c0, row + c0 + n);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "blockwise attention gives a (sequence, head) the same bits whatever B and the heads computed with it") {
  const Shape s{3, 150, 4, 2, 16};
  const auto qkv = to_float(random_vec(s.qkv(), 251)), d = to_float(random_vec(s.out(), 252));
  const int OC = s.H * s.hd;
  std::vector<kernels::Bf16Path> paths{kernels::Bf16Path::kEmulated};
  if (!kernels::onednn_bf16_impl().empty()) paths.push_back(kernels::Bf16Path::kOneDnn);
  const kernels::Bf16Path before = kernels::bf16_path();
  // kind 0: fp32; 1, 2: bf16 on each path.
  for (int kind = 0; kind <= int(paths.size()); ++kind) {
    if (kind > 0) kernels::set_bf16_path(paths[kind - 1]);
    INFO("kind " << kind);
    auto run = [&](const Shape& sh, const std::vector<float>& x, const std::vector<float>& dy,
                   std::vector<float>& out, std::vector<float>& dx) {
      out.assign(sh.out(), 0.0f);
      dx.assign(sh.qkv(), 0.0f);
      std::vector<float> lse(sh.lse());
      if (kind == 0) {
        kernels::attention_forward(out.data(), lse.data(), x.data(), sh.B, sh.T, sh.H, sh.K, sh.hd);
        kernels::attention_backward(dx.data(), dy.data(), x.data(), out.data(), lse.data(), sh.B, sh.T, sh.H,
                                    sh.K, sh.hd);
        return;
      }
      std::vector<bf16> xh(x.size()), oh(sh.out());
      kernels::round_to_bf16(xh.data(), x.data(), x.size());
      std::vector<float> scratch(size_t(sh.T) * sh.R());
      kernels::attention_forward_bf16(out.data(), lse.data(), xh.data(), scratch.data(), sh.B, sh.T, sh.H,
                                      sh.K, sh.hd);
      kernels::round_to_bf16(oh.data(), out.data(), out.size());
      kernels::attention_backward_bf16(dx.data(), dy.data(), xh.data(), scratch.data(), oh.data(), lse.data(),
                                       sh.B, sh.T, sh.H, sh.K, sh.hd);
    };
    std::vector<float> out, dx;
    run(s, qkv, d, out, dx);
    // Sequence 1 alone, with heads 2, 3 only (KV head 1: a rank of tp 2).
    const Shape one{1, s.T, 2, 1, s.hd};
    std::vector<float> out1, dx1;
    run(one, slice_qkv(qkv, s, 1, 2, 2), slice_rows(d, s.T, OC, 1, 2 * s.hd, 2 * s.hd), out1, dx1);
    CHECK(out1 == slice_rows(out, s.T, OC, 1, 2 * s.hd, 2 * s.hd));
    std::vector<float> dx_full_slice = slice_qkv(dx, s, 1, 2, 2);
    CHECK(dx1 == dx_full_slice);
  }
  kernels::set_bf16_path(before);
}

namespace {

double round_d(double x) { return kernels::from_bf16(kernels::to_bf16(float(x))); }

// The bf16 blockwise scheme in double. Forward: per row, the keys in blocks of kAttentionKeys; m_c
// the running maximum of the scaled scores through block c; each key's exp(s - m_c) rounded to
// bf16 and rescaled to the last maximum; the sum l of the unrounded exp(s - m) in fp32-free
// double; out = that sum over v / l. Backward: P = exp(s - lse) (lse = m + log l), rounded for
// P^T dout; dout rounded; D = dout . out with out as saved (bf16); dS = P (dP - D) scale rounded
// for dS k and dS^T q.
void bf16_scheme(std::vector<double>& out, std::vector<double>& dqkv, const std::vector<bf16>& qkv,
                 const std::vector<float>& dout, const Shape& s) {
  const int R = s.R(), OC = s.H * s.hd, g = s.H / s.K, hd = s.hd, T = s.T;
  const double scale = 1.0 / std::sqrt(double(hd));
  out.assign(s.out(), 0.0);
  dqkv.assign(s.qkv(), 0.0);
  auto x = [&](int b, int t, int col) {
    return double(kernels::from_bf16(qkv[(size_t(b) * T + t) * R + col]));
  };
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      const int qc = h * hd, kc = (s.H + h / g) * hd, vc = (s.H + s.K + h / g) * hd;
      std::vector<double> lse(T);
      for (int t = 0; t < T; ++t) {
        std::vector<double> sc(t + 1), mc(t + 1);
        for (int u = 0; u <= t; ++u) {
          double v = 0.0;
          for (int i = 0; i < hd; ++i) v += x(b, t, qc + i) * x(b, u, kc + i);
          sc[u] = v * scale;
        }
        double m = -1e300;
        for (int c0 = 0; c0 <= t; c0 += kernels::kAttentionKeys) {
          const int c1 = std::min(t + 1, c0 + kernels::kAttentionKeys);
          for (int u = c0; u < c1; ++u) m = std::max(m, sc[u]);
          for (int u = c0; u < c1; ++u) mc[u] = m;
        }
        double l = 0.0;
        for (int u = 0; u <= t; ++u) l += std::exp(sc[u] - m);
        lse[t] = m + std::log(l);
        for (int i = 0; i < hd; ++i) {
          double o = 0.0;
          for (int u = 0; u <= t; ++u)
            o += round_d(std::exp(sc[u] - mc[u])) * std::exp(mc[u] - m) * x(b, u, vc + i);
          out[(size_t(b) * T + t) * OC + qc + i] = o / l;
        }
      }
      auto d = [&](int t, int i) { return round_d(dout[(size_t(b) * T + t) * OC + qc + i]); };
      for (int t = 0; t < T; ++t) {
        double D = 0.0;
        for (int i = 0; i < hd; ++i) D += d(t, i) * round_d(out[(size_t(b) * T + t) * OC + qc + i]);
        for (int u = 0; u <= t; ++u) {
          double v = 0.0, dp = 0.0;
          for (int i = 0; i < hd; ++i) {
            v += x(b, t, qc + i) * x(b, u, kc + i);
            dp += d(t, i) * x(b, u, vc + i);
          }
          const double p = std::exp(v * scale - lse[t]);
          const double ds = round_d(p * (dp - D) * scale), pr = round_d(p);
          for (int i = 0; i < hd; ++i) {
            dqkv[(size_t(b) * T + t) * R + qc + i] += ds * x(b, u, kc + i);
            dqkv[(size_t(b) * T + u) * R + kc + i] += ds * x(b, t, qc + i);
            dqkv[(size_t(b) * T + u) * R + vc + i] += pr * d(t, i);
          }
        }
      }
    }
}

}  // namespace

// Measured max_rel_diff against the scheme, worst of K = 2, 4: out 7.4e-5, dqkv 1.1e-4 on both
// paths; the fp32 kernel on the same bf16 q, k, v is 8e-4 and 2.2e-3 away.
TEST_CASE(
    "bf16 blockwise attention rounds the probabilities, the output gradient and the scores' gradient, on "
    "every path") {
  for (int K : {2, 4}) {
    const Shape s{2, 150, 4, K, 8};  // T past a 128-key block and two 64-row blocks
    const auto xf = random_vec(s.qkv(), 261 + K);
    std::vector<bf16> qkv(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) qkv[i] = kernels::to_bf16(float(xf[i]));
    std::vector<float> qkvf(qkv.size());
    kernels::widen_bf16(qkvf.data(), qkv.data(), qkv.size());
    const auto dout = to_float(random_vec(s.out(), 262 + K));
    std::vector<double> want_out, want_d;
    bf16_scheme(want_out, want_d, qkv, dout, s);
    INFO("K = " << K);
    // The fp32 kernel (nothing rounded past q, k, v) differs from the scheme visibly.
    const Fp32Run r32 = run_fp32(s, qkvf, dout);
    CHECK(max_rel_diff(r32.out, want_out) > 5e-4);
    CHECK(max_rel_diff(r32.dqkv, want_d) > 5e-4);

    std::vector<kernels::Bf16Path> paths{kernels::Bf16Path::kEmulated};
    if (!kernels::onednn_bf16_impl().empty()) paths.push_back(kernels::Bf16Path::kOneDnn);
    const kernels::Bf16Path before = kernels::bf16_path();
    for (auto path : paths) {
      kernels::set_bf16_path(path);
      INFO("path " << kernels::bf16_path_name(path));
      std::vector<float> qkv32(size_t(s.T) * s.R()), o(s.out()), lse(s.lse()), d(s.qkv());
      std::vector<bf16> oh(s.out());
      // Each form of q, k, v (bf16, fp32, both) gives the same, bit for bit.
      const kernels::Bf16Src forms[] = {kernels::Bf16Src(qkv.data()), kernels::Bf16Src::widened(qkvf.data()),
                                        kernels::Bf16Src::both(qkv.data(), qkvf.data())};
      std::vector<float> o0, d0;
      for (const auto& src : forms) {
        kernels::attention_forward_bf16(o.data(), lse.data(), src, qkv32.data(), s.B, s.T, s.H, s.K, s.hd);
        kernels::round_to_bf16(oh.data(), o.data(), o.size());
        kernels::attention_backward_bf16(d.data(), dout.data(), src, qkv32.data(), oh.data(), lse.data(), s.B,
                                         s.T, s.H, s.K, s.hd);
        CHECK(max_rel_diff(lse, std::vector<double>(r32.lse.begin(), r32.lse.end())) < 1e-5);  // fp32 softmax
        // An order of fp32 sums may flip the odd rounding to bf16, a bf16 ulp of one term.
        CHECK(max_rel_diff(o, want_out) < 4e-4);
        CHECK(max_rel_diff(d, want_d) < 4e-4);
        if (o0.empty()) {
          o0 = o;
          d0 = d;
        } else if (path == kernels::Bf16Path::kEmulated || src.h) {
          CHECK(o == o0);
          CHECK(d == d0);
        }
      }
    }
    kernels::set_bf16_path(before);
  }
}

// Context parallelism's blocks (kernels.h attention_block_forward/backward): a sequence of two
// chunks, the second chunk's queries against the first chunk's keys (all visible) and against its
// own (causal), merged by their log-sum-exps as the ring merges them, give the whole attention's
// rows; their backwards, given the whole attention's lse and row terms, sum to its gradients.
TEST_CASE("context-parallel attention blocks merge into the whole sequence's attention and gradients") {
  const int H = 4, hd = 16;
  for (int K : {1, 2, 4})
    for (int L : {7, 130}) {
      const int T = 2 * L, R = (H + 2 * K) * hd, OC = H * hd;
      const Shape s{1, T, H, K, hd};
      const auto qkv = to_float(random_vec(s.qkv(), 431 + K + L)), d = to_float(random_vec(s.out(), 432 + K + L));
      const Fp32Run whole = run_fp32(s, qkv, d);
      INFO("K = " << K << " L = " << L);
      // Forward of chunk 1: the causal block on its own keys, then the earlier chunk merged in.
      const float* q1 = qkv.data() + size_t(L) * R;
      const float* k0 = qkv.data() + OC;
      const float* k1 = k0 + size_t(L) * R;
      std::vector<float> o(size_t(L) * OC), l(size_t(H) * L), po(o.size()), pl(l.size());
      kernels::attention_block_forward(o.data(), OC, l.data(), L, q1, R, k1, k1 + K * hd, R, L, L, true, H, K, hd);
      kernels::attention_block_forward(po.data(), OC, pl.data(), L, q1, R, k0, k0 + K * hd, R, L, L, false, H, K, hd);
      double worst = 0;
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < L; ++i) {
          const double la = l[size_t(h) * L + i], lp = pl[size_t(h) * L + i];
          const double m = std::max(la, lp), sum = std::exp(la - m) + std::exp(lp - m);
          const double lse = m + std::log(sum);
          worst = std::max(worst, std::abs(lse - whole.lse[size_t(h) * T + L + i]));
          for (int x = 0; x < hd; ++x) {
            const size_t at = size_t(i) * OC + size_t(h) * hd + x;
            const double merged = (std::exp(la - m) * o[at] + std::exp(lp - m) * po[at]) / sum;
            worst = std::max(worst, std::abs(merged - whole.out[size_t(L) * OC + at]));
          }
        }
      CHECK(worst < 1e-5);
      // Backward: every (query chunk, key chunk) block that the mask does not empty, added up.
      std::vector<float> D(size_t(H) * T), dqkv(s.qkv(), 0.0f);
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) {
          double v = 0;
          for (int x = 0; x < hd; ++x)
            v += double(d[size_t(t) * OC + h * hd + x]) * whole.out[size_t(t) * OC + h * hd + x];
          D[size_t(h) * T + t] = float(v);
        }
      auto block = [&](int qc, int kc) {
        const size_t qr = size_t(qc) * L, kr = size_t(kc) * L;
        float* dk = dqkv.data() + kr * R + OC;
        kernels::attention_block_backward(dqkv.data() + qr * R, R, dk, dk + K * hd, R, d.data() + qr * OC, OC,
                                          D.data() + qr, whole.lse.data() + qr, T, qkv.data() + qr * R, R,
                                          qkv.data() + kr * R + OC, qkv.data() + kr * R + OC + K * hd, R, L, L,
                                          qc == kc, H, K, hd);
      };
      block(0, 0), block(1, 0), block(1, 1);
      CHECK(max_rel_diff(dqkv, std::vector<double>(whole.dqkv.begin(), whole.dqkv.end())) < 1e-5);
    }
}
