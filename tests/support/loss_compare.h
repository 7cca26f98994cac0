// Catch2 checks shared by the tests that compare runs: one run's per-step figures against a
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

// got and want hold as many figures (at least one), each of got within rel (relative) of want's.
inline void check_all_close(const std::vector<double>& got, const std::vector<double>& want, double rel) {
  INFO("tolerance " << rel);
  REQUIRE(got.size() == want.size());
  REQUIRE(!want.empty());
  for (size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i] << " vs " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= rel * std::abs(want[i]));
  }
}

}  // namespace trn::test
