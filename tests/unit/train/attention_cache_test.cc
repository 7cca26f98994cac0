// Blockwise attention over a KV cache (kernels.h attention_forward_rows, which the KV-cached
// decoders of trn-generate call): n new query rows at positions t0 .. t0 + n - 1 against keys and
// values held apart, against its reference twin (ref.h) in double, and the training kernel as the
// case t0 = 0.
//
// Shapes: a prefill from position 0 (n = the prompt), a prefill after a cached prefix (t0 > 0,
// n > 1: the last key block of a query block may lie wholly right of its first rows), and
// single-row decoding (n = 1, which takes a group's query heads as the rows of one product) at
// positions on and off the block edges (kAttentionRows = kAttentionKeys = 128); GQA (K < H, groups
// of 2 to 8) and MHA (K == H); row strides wider than the rows, so a wrong stride reads the
// padding. Float tolerance 1e-5 of the largest magnitude, as for the
// training kernel (attention_test.cc): a correct kernel is far below it, a skipped block, a lost
// rescale or a wrong mask is off by O(1e-2) or more.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <vector>

#include "runtime/kernels/kernels.h"
#include "runtime/kernels/ref.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;
using namespace trn::test;
namespace ref = trn::kernels::ref;

namespace {

// A layout like the decoders': q rows with room past the heads (a fused qkv row), the cache's
// rows of K heads with padding, out rows and lse rows with padding.
struct Case {
  int t0, n, H, K, hd;
  int64_t qs() const { return int64_t(H + 2 * K) * hd + 3; }
  int64_t ks() const { return int64_t(K) * hd + 5; }
  int64_t os() const { return int64_t(H) * hd + 2; }
  int64_t ls() const { return n + 1; }
  size_t cached() const { return size_t(t0) + n; }
};

constexpr float kSentinel = 12345.0f;

}  // namespace

// Measured max_rel_diff against the twin in double, worst over these cases: out 4.6e-7, lse
// 1.1e-7 (AVX-512, oneDNN products); out 4.6e-7, lse 2.3e-7 with cblas_sgemm's (the AVX2 path).
TEST_CASE("blockwise attention over a KV cache matches its reference twin: prefill, prefill after a prefix, decode") {
  // Both product paths on any CPU: oneDNN where it runs (AVX-512), and cblas_sgemm.
  const bool blas = GENERATE(false, true);
  kernels::set_attention_blas(blas);
  INFO("cblas products " << blas);
  const int shapes[][3] = {{4, 4, 16}, {4, 2, 16}, {4, 1, 16}, {6, 3, 8}, {8, 1, 16}};  // H, K, hd
  const int positions[][2] = {
      {0, 1},   {0, 7},   {0, 128},  {0, 129}, {0, 300},                        // prefill from position 0
      {5, 3},   {37, 150}, {100, 60}, {128, 130}, {200, 57}, {255, 2},          // prefill after a cached prefix
      {1, 1},   {5, 1},   {127, 1},  {128, 1},  {129, 1},   {255, 1}, {300, 1}  // decode: one row
  };
  for (const auto& sh : shapes)
    for (const auto& p : positions) {
      const Case c{p[0], p[1], sh[0], sh[1], sh[2]};
      INFO("t0 " << c.t0 << " n " << c.n << " H " << c.H << " K " << c.K << " hd " << c.hd);
      const uint64_t seed = 1000 + 7 * c.t0 + 13 * c.n + c.K;
      const auto q = random_vec(size_t(c.n) * c.qs(), seed), k = random_vec(c.cached() * c.ks(), seed + 1),
                 v = random_vec(c.cached() * c.ks(), seed + 2);
      std::vector<double> out(size_t(c.n) * c.os()), lse(size_t(c.H) * c.ls());
      ref::attention_forward_rows(out.data(), c.os(), lse.data(), c.ls(), q.data(), c.qs(), k.data(), v.data(), c.ks(),
                                  c.t0, c.n, c.H, c.K, c.hd);
      const auto qf = to_float(q), kf = to_float(k), vf = to_float(v);
      std::vector<float> o(out.size(), kSentinel), l(lse.size(), kSentinel);
      kernels::attention_forward_rows(o.data(), c.os(), l.data(), c.ls(), qf.data(), c.qs(), kf.data(), vf.data(),
                                      c.ks(), c.t0, c.n, c.H, c.K, c.hd);
      // Compare the written entries; the padding keeps its sentinel.
      std::vector<double> want, pad_want;
      std::vector<float> got;
      int pad_touched = 0;
      for (int i = 0; i < c.n; ++i)
        for (int64_t x = 0; x < c.os(); ++x) {
          const size_t at = size_t(i) * c.os() + x;
          if (x < int64_t(c.H) * c.hd) {
            want.push_back(out[at]);
            got.push_back(o[at]);
          } else {
            pad_touched += o[at] != kSentinel;
          }
        }
      CHECK(max_rel_diff(got, want) < 1e-5);
      want.clear();
      got.clear();
      for (int h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.ls(); ++i) {
          const size_t at = size_t(h) * c.ls() + i;
          if (i < c.n) {
            want.push_back(lse[at]);
            got.push_back(l[at]);
          } else {
            pad_touched += l[at] != kSentinel;
          }
        }
      CHECK(max_rel_diff(got, want) < 1e-5);
      CHECK(pad_touched == 0);
      // Without lse (the decoders): the same output.
      std::vector<float> o2(o.size(), kSentinel);
      kernels::attention_forward_rows(o2.data(), c.os(), nullptr, 0, qf.data(), c.qs(), kf.data(), vf.data(), c.ks(),
                                      c.t0, c.n, c.H, c.K, c.hd);
      CHECK(std::memcmp(o2.data(), o.data(), o.size() * sizeof(float)) == 0);
    }
  kernels::set_attention_blas(false);
}

// Measured: rows one at a time 1.5e-7 of the largest magnitude, the split prefill 0 (oneDNN) and
// 1.3e-7, 8.8e-8 (cblas_sgemm).
TEST_CASE("decoding one row at a time over a KV cache equals a prefill of the same rows") {
  const bool blas = GENERATE(false, true);
  kernels::set_attention_blas(blas);
  INFO("cblas products " << blas);
  const int T = 300, H = 4, K = 2, hd = 16;
  const Case c{0, T, H, K, hd};
  const auto q = to_float(random_vec(size_t(T) * c.qs(), 77)), k = to_float(random_vec(size_t(T) * c.ks(), 78)),
             v = to_float(random_vec(size_t(T) * c.ks(), 79));
  std::vector<float> whole(size_t(T) * c.os()), steps(whole.size()), split(whole.size());
  kernels::attention_forward_rows(whole.data(), c.os(), nullptr, 0, q.data(), c.qs(), k.data(), v.data(), c.ks(), 0, T,
                                  H, K, hd);
  for (int t = 0; t < T; ++t)
    kernels::attention_forward_rows(steps.data() + size_t(t) * c.os(), c.os(), nullptr, 0, q.data() + size_t(t) * c.qs(),
                                    c.qs(), k.data(), v.data(), c.ks(), t, 1, H, K, hd);
  // A prefill of 150 rows, then the other 150 as a second prefill over the cache.
  kernels::attention_forward_rows(split.data(), c.os(), nullptr, 0, q.data(), c.qs(), k.data(), v.data(), c.ks(), 0,
                                  150, H, K, hd);
  kernels::attention_forward_rows(split.data() + size_t(150) * c.os(), c.os(), nullptr, 0,
                                  q.data() + size_t(150) * c.qs(), c.qs(), k.data(), v.data(), c.ks(), 150, T - 150, H,
                                  K, hd);
  double worst_steps = 0, worst_split = 0, mag = 1;
  for (int t = 0; t < T; ++t)
    for (int x = 0; x < H * hd; ++x) {
      const size_t at = size_t(t) * c.os() + x;
      worst_steps = std::max(worst_steps, double(std::abs(steps[at] - whole[at])));
      worst_split = std::max(worst_split, double(std::abs(split[at] - whole[at])));
      mag = std::max(mag, double(std::abs(whole[at])));
    }
  CHECK(worst_steps / mag < 1e-5);
  CHECK(worst_split / mag < 1e-5);
  kernels::set_attention_blas(false);
}

// (Not at T = 1 with K < H: a single row takes its group's query heads as the rows of one product,
// checked against the twin above.)
TEST_CASE("attention_forward is attention_forward_rows over each sequence's qkv rows from position 0, bit for bit") {
  const int B = 2, H = 4, hd = 16;
  for (const bool blas : {false, true}) {
    kernels::set_attention_blas(blas);
    for (int K : {1, 2, 4})
      for (int T : {2, 129, 300}) {
        INFO("cblas " << blas << " K " << K << " T " << T);
        const int64_t R = int64_t(H + 2 * K) * hd, OC = int64_t(H) * hd;
        const auto qkv = to_float(random_vec(size_t(B) * T * R, 500 + K + T));
        std::vector<float> out(size_t(B) * T * OC), lse(size_t(B) * H * T), out2(out.size()), lse2(lse.size());
        kernels::attention_forward(out.data(), lse.data(), qkv.data(), B, T, H, K, hd);
        for (int b = 0; b < B; ++b) {
          const float* x = qkv.data() + size_t(b) * T * R;
          kernels::attention_forward_rows(out2.data() + size_t(b) * T * OC, OC, lse2.data() + size_t(b) * H * T, T, x,
                                          R, x + H * hd, x + (H + K) * hd, R, 0, T, H, K, hd);
        }
        CHECK(std::memcmp(out.data(), out2.data(), out.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(lse.data(), lse2.data(), lse.size() * sizeof(float)) == 0);
      }
  }
  kernels::set_attention_blas(false);
}
