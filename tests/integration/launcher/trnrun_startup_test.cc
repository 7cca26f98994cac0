// Start-up ends promptly: a usage error every rank makes is printed by every rank, and SIGTERM
// during a worker's start-up ends it at once, whatever the timing.
#include <catch2/catch.hpp>
#include <signal.h>

#include <filesystem>
#include <thread>

#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// The hang guard of one try, not the assertion (a try fails on its exit code and its lines). A
// try takes about 0.5 s on an idle host and 2 s on a loaded 2-core one; trnrun's own join to its
// embedded coordinator stalls now and then under load for 5 s more (a gRPC reconnect backoff,
// seen in about 1 start in 30 while builds ran beside it), which a 5 s guard would take for the
// hang. The hang lasted until trnrun's SIGKILL at the end of the grace period, which the test
// sets to 30 s, so 8 s stays far below it while leaving load its room.
constexpr auto kTryGuard = 8s;

// True once any file (not a lock file) is in dir: a rank published its fabric address there.
bool has_record(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind(".", 0) != 0) return true;
  return false;
}

}  // namespace

// Each rank finds TRN_FABRIC_RAILS=0 wrong when its fabric starts, about a second in; the first
// one to exit used to have trnrun SIGTERM the other in the middle of fi_getinfo, where a
// library's SIGTERM handler calling exit() deadlocked on libfabric's lock: 10.5 s, one try in 2
// to 12, and no line from that rank.
TEST_CASE("a usage error of every rank ends trnrun with every rank's own line, 30 tries in a row") {
  const std::vector<std::string> argv = {bin("trnrun"), "--nproc-per-node", "2", "--grace-period", "30", "--",
                                         bin("trn-train"), "--model", "tiny", "--dp", "2"};
  const std::string line = "trn-train: error: TRN_FABRIC_RAILS=0: ";
  for (int attempt = 1; attempt <= 30; ++attempt) {
    auto r = run_all({ProcSpec{argv, {{"TRN_FABRIC_RAILS", "0"}}}}, kTryGuard).at(0);
    INFO("try " << attempt << ": " << r.describe());
    REQUIRE_FALSE(r.timed_out);
    REQUIRE(r.exit_code == 2);
    REQUIRE(r.output.find("[rank 0] " + line) != std::string::npos);
    REQUIRE(r.output.find("[rank 1] " + line) != std::string::npos);
  }
}

// A rank waiting for its peer's address has been through fi_getinfo and opened its endpoints:
// every handler a library installs for SIGTERM is in place. The signal must end it as SIGTERM
// does (not exit 1 from a library's handler, not a hang).
TEST_CASE("SIGTERM ends a trn-train rank waiting in start-up at once, killed by SIGTERM") {
  TempDir store;
  Process rank1({{bin("trn-train"), "--model", "tiny", "--dp", "2"},
                 {{"TRN_RANK", "1"}, {"TRN_WORLD_SIZE", "2"}, {"TRN_LOCAL_RANK", "1"},
                  {"TRN_STORE_DIR", store.path()}}});
  const auto published_by = std::chrono::steady_clock::now() + 60s;
  while (!has_record(store.path()) && rank1.running() && std::chrono::steady_clock::now() < published_by)
    std::this_thread::sleep_for(10ms);
  REQUIRE(has_record(store.path()));
  REQUIRE(rank1.running());
  rank1.signal(SIGTERM);
  auto r = rank1.wait(std::chrono::steady_clock::now() + kTryGuard);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.signal == SIGTERM);
}
