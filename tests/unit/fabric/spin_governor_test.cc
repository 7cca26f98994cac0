// The fabric's spin governor (collectives/fabric/waiters.h): when waits stop spinning and when
// they spin again.
#include <catch2/catch.hpp>

#include <chrono>

#include "collectives/fabric/waiters.h"

using trn::fabric::SpinGovernor;
using Outcome = SpinGovernor::Outcome;

TEST_CASE("spin governor: how a wait ended") {
  using std::chrono::microseconds;
  const int few = SpinGovernor::kFewYields;
  CHECK(SpinGovernor::outcome(0, false, 0, false, false) == Outcome::kNeither);  // done at the first poll
  CHECK(SpinGovernor::outcome(5, false, 0, false, false) == Outcome::kCaught);   // the spin saw it land
  // Right after a yield that let the peer run on this core.
  CHECK(SpinGovernor::outcome(9, true, 1, true, false) == Outcome::kMissed);
  CHECK(SpinGovernor::outcome(9, true, few, true, false) == Outcome::kMissed);
  CHECK(SpinGovernor::outcome(9, true, few + 1, true, false) == Outcome::kNeither);  // a slow peer
  CHECK(SpinGovernor::outcome(9, true, 1, false, false) == Outcome::kNeither);       // nobody else ran here
  CHECK(SpinGovernor::outcome(9, true, 0, false, true) == Outcome::kNeither);        // it slept
  CHECK_FALSE(SpinGovernor::gave_core(microseconds(1)));     // a bare yield
  CHECK(SpinGovernor::gave_core(microseconds(15)));          // the peer's hop
  CHECK_FALSE(SpinGovernor::gave_core(microseconds(4000)));  // a slice of other work
}

TEST_CASE("spin governor: misses in a row stop the spin, probes look again, a caught spin restores it") {
  SpinGovernor g;
  for (int i = 0; i < SpinGovernor::kSkipAfter; ++i) {
    REQUIRE(g.should_spin());
    g.record(Outcome::kMissed);
  }
  // Skipping: one wait in kProbeEvery spins.
  int spins = 0;
  for (uint32_t i = 0; i < 4 * SpinGovernor::kProbeEvery; ++i) {
    if (g.should_spin()) ++spins;
    g.record(Outcome::kMissed);
  }
  CHECK(spins == 4);
  // Outcomes that say nothing neither stop nor restore it.
  while (!g.should_spin()) g.record(Outcome::kNeither);
  g.record(Outcome::kNeither);
  CHECK_FALSE(g.should_spin());
  // A probe that catches its completion brings the spin back for every wait.
  while (!g.should_spin()) g.record(Outcome::kMissed);
  g.record(Outcome::kCaught);
  for (uint32_t i = 0; i < 3 * SpinGovernor::kProbeEvery; ++i) CHECK(g.should_spin());
}

TEST_CASE("spin governor: misses apart from each other never stop the spin") {
  SpinGovernor g;
  for (int i = 0; i < 100; ++i) {
    REQUIRE(g.should_spin());
    g.record(i % SpinGovernor::kSkipAfter == 0 ? Outcome::kCaught : Outcome::kMissed);
  }
}
