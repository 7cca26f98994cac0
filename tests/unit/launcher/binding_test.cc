#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "collectives/core/error.h"
#include "launcher/agent/binding.h"

using namespace trn::launch;
using Sets = std::vector<std::vector<int>>;

TEST_CASE("binding: with enough cores each rank gets whole cores, in contiguous blocks") {
  // 4 cores, 2 threads each, numbered as x86 Linux does: cpus 0-3 first threads, 4-7 siblings.
  const std::vector<int> cpus = {0, 1, 2, 3, 4, 5, 6, 7}, keys = {0, 1, 2, 3, 0, 1, 2, 3};
  CHECK(split_cpus(cpus, keys, 2) == Sets{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(split_cpus(cpus, keys, 4) == Sets{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // 3 ranks on 4 cores: the blocks differ by at most one core.
  CHECK(split_cpus(cpus, keys, 3) == Sets{{0, 4}, {1, 5}, {2, 3, 6, 7}});
  CHECK(split_cpus(cpus, keys, 1) == Sets{cpus});
}

TEST_CASE("binding: more ranks than cores splits single cpus, siblings next to each other") {
  const std::vector<int> cpus = {0, 1, 2, 3}, keys = {0, 1, 0, 1};  // 2 cores, 2 threads each
  CHECK(split_cpus(cpus, keys, 4) == Sets{{0}, {2}, {1}, {3}});
  CHECK(split_cpus(cpus, keys, 3) == Sets{{0}, {2}, {1, 3}});
}

TEST_CASE("binding: a mask with gaps (taskset, a cpuset) is divided, never widened; too few cpus give nothing") {
  const std::vector<int> cpus = {3, 5, 9}, keys = {3, 5, 9};
  CHECK(split_cpus(cpus, keys, 2) == Sets{{3}, {5, 9}});
  CHECK(split_cpus(cpus, keys, 3) == Sets{{3}, {5}, {9}});
  CHECK(split_cpus(cpus, keys, 4).empty());
}

TEST_CASE("binding: this process's plan is disjoint shares of its own cpus") {
  const std::vector<int> mine = allowed_cpus();
  REQUIRE_FALSE(mine.empty());
  CHECK(plan_binding(Bind::kNone, 1).empty());
  const int ranks = static_cast<int>(mine.size());
  const Sets sets = plan_binding(Bind::kAuto, ranks);
  REQUIRE(sets.size() == mine.size());
  std::set<int> seen;
  for (const auto& s : sets) {
    REQUIRE(s.size() == 1);
    CHECK(std::count(mine.begin(), mine.end(), s[0]) == 1);
    CHECK(seen.insert(s[0]).second);
  }
  // More workers than cpus: auto leaves them unbound, core refuses with a usage error.
  CHECK(plan_binding(Bind::kAuto, ranks + 1).empty());
  try {
    plan_binding(Bind::kCore, ranks + 1);
    FAIL("expected a usage error");
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("--bind none"));
  }
}

TEST_CASE("binding: cpu lists print as ranges") {
  CHECK(format_cpu_list({}).empty());
  CHECK(format_cpu_list({4}) == "4");
  CHECK(format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
}
