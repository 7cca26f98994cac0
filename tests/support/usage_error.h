// Catch2 check for a program's usage error: exit 2 and one line "<program>: error: ..." that
// holds every phrase.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace trn::test {

inline void expect_usage_error(const ProcResult& r, const std::vector<std::string>& phrases,
                               const std::string& program = "trn-train") {
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK(r.output.rfind(program + ": error: ", 0) == 0);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  for (const auto& p : phrases) CHECK(r.output.find(p) != std::string::npos);
}

}  // namespace trn::test
