// Catch2 check shared by the reduced-precision tests: one run's per-step losses against a
// reference run's.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace trn::test {

// Both runs logged `steps` losses, every step's within `tol` (relative) of the reference's, and
// the runs differ somewhere (the other precision really ran). Returns the largest difference.
inline double check_losses_close(const std::vector<double>& reference, const std::vector<double>& other,
                                 size_t steps, double tol) {
  REQUIRE(reference.size() == steps);
  REQUIRE(other.size() == steps);
  double worst = 0.0;
  for (size_t i = 0; i < steps; ++i) {
    const double rel = std::abs(other[i] - reference[i]) / std::abs(reference[i]);
    INFO("step " << i + 1 << ": reference " << reference[i] << ", other " << other[i]);
    CHECK(rel <= tol);
    worst = std::max(worst, rel);
  }
  CHECK(reference != other);
  return worst;
}

}  // namespace trn::test
