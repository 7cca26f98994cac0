#include <catch2/catch.hpp>

#include <set>

#include "collectives/core/settings.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/tag.h"

using namespace trn;
using namespace trn::fabric;

TEST_CASE("wire tags: the user's 56 bits pass through, pieces and control use the top 8") {
  const uint64_t user = 0x00ab'cdef'0123'4567;
  CHECK(wire::user_part(wire::user(user, 0)) == user);
  CHECK(wire::user(user, 0) == user);
  for (uint64_t i : {1, 2, 126, 127, 128, 1000}) {
    CHECK(wire::user_part(wire::user(user, i)) == user);
    CHECK((wire::user(user, i) & wire::kControlBit) == 0);
    CHECK(wire::user(user, i) != wire::user(user, 0));  // a later piece never matches a first one
  }
  // Consecutive pieces differ over a full cycle; the cycle then repeats.
  std::set<uint64_t> seen;
  for (uint64_t i = 1; i <= wire::kPieceCycle; ++i) seen.insert(wire::user(user, i));
  CHECK(seen.size() == wire::kPieceCycle);
  CHECK(wire::user(user, 1) == wire::user(user, 1 + wire::kPieceCycle));
  CHECK((wire::control(1) & wire::kControlBit) != 0);
  CHECK(wire::control(1) != wire::user(1, 0));
}

TEST_CASE("options come from the environment") {
  setenv("TRN_FABRIC_PROVIDER", "shm", 1);
  setenv("TRN_FABRIC_SHM", "0", 1);
  setenv("TRN_GENERATION", "7", 1);
  setenv("TRN_TIMEOUT", "12", 1);
  settings::reload_for_testing();
  Options o = Options::from_environment();
  CHECK(o.provider == "shm");
  CHECK(o.shm == 0);
  CHECK(o.prefix == "fabric/g7");
  CHECK(o.connect_timeout == std::chrono::seconds(12));
  unsetenv("TRN_FABRIC_SHM");
  unsetenv("TRN_FABRIC_PROVIDER");
  settings::reload_for_testing();
  CHECK(Options::from_environment().shm == -1);
  CHECK(Options::from_environment().provider == "auto");
  unsetenv("TRN_GENERATION");
  unsetenv("TRN_TIMEOUT");
  settings::reload_for_testing();
}
