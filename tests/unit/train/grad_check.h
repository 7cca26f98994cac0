// Helpers for gradient checks: random buffers and central finite differences in double.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "runtime/util/random.h"

namespace trn::test {

inline std::vector<double> random_vec(size_t n, uint64_t seed, double scale = 1.0) {
  Rng r(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = r.normal() * scale;
  return v;
}

inline std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// Checks analytic[i] against (loss(x + h e_i) - loss(x - h e_i)) / 2h for every i (or a sample
// of `max_checks` evenly spread indices). In double with h = 1e-5 the truncation error is
// ~1e-10, so a relative tolerance of 1e-6 catches any wrong term.
inline void check_gradient(const char* what, std::vector<double>& x,
                           const std::vector<double>& analytic, const std::function<double()>& loss,
                           size_t max_checks = 400, double tol = 1e-6) {
  REQUIRE(x.size() == analytic.size());
  const size_t n = x.size();
  const size_t stride = std::max<size_t>(1, n / max_checks);
  double worst = 0.0;
  for (size_t i = 0; i < n; i += stride) {
    const double saved = x[i], h = 1e-5;
    x[i] = saved + h;
    const double lp = loss();
    x[i] = saved - h;
    const double lm = loss();
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * h);
    const double err = std::abs(numeric - analytic[i]) / (1.0 + std::abs(numeric));
    worst = std::max(worst, err);
    if (err > tol) {
      INFO(what << " index " << i << ": analytic " << analytic[i] << " numeric " << numeric);
      CHECK(err <= tol);
      return;
    }
  }
  INFO(what << " worst relative error " << worst);
  CHECK(worst <= tol);
}

// max |a - b| / max(1, max |b|): float kernels against double references.
inline double max_rel_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double diff = 0.0, mag = 1.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - b[i]));
    mag = std::max(mag, std::abs(b[i]));
  }
  return diff / mag;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace trn::test
