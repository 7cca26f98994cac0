// The agent's decisions (restart, give up, finish, follow the generation) against an in-process
// fake control plane, with real worker processes (/bin/sh scripts).
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "launcher/agent/agent.h"
#include "launcher/agent/plan.h"
#include "tests/support/process.h"

using namespace trn::launch;
using namespace std::chrono_literals;

namespace {

// One node's view of a coordinator: generations move on when a failure is reported or when the
// test says so.
class FakeControlPlane : public ControlPlane {
 public:
  trn::control::JoinResult join(const trn::control::JoinRequest& r) override {
    std::lock_guard lock(mu_);
    ++joins;
    trn::control::JoinResult j;
    j.generation = generation;
    j.nnodes = 1;
    j.world_size = r.nproc_per_node;
    return j;
  }
  trn::control::HeartbeatReply node_heartbeat(const std::string&, int64_t gen, int,
                                              const std::vector<trn::control::ForwardedHeartbeat>&,
                                              const std::string&) override {
    std::lock_guard lock(mu_);
    ++heartbeats;
    return {gen < generation, generation, "test moved it"};
  }
  void report_failure(const std::string&, int64_t gen, int rank, const std::string& reason, bool) override {
    std::lock_guard lock(mu_);
    failures.push_back({rank, reason});
    if (gen == generation) ++generation;
  }
  void finish(const std::string&, int64_t gen, int) override {
    std::lock_guard lock(mu_);
    finished_generation = gen;
  }
  void report_stop(const std::string&, int64_t, int rank, const std::string& reason) override {
    std::lock_guard lock(mu_);
    stops.push_back({rank, reason});
  }
  void move_on() {
    std::lock_guard lock(mu_);
    ++generation;
  }

  std::mutex mu_;
  int64_t generation = 0;
  int joins = 0;
  int heartbeats = 0;
  int64_t finished_generation = -1;
  std::vector<std::pair<int, std::string>> failures;
  std::vector<std::pair<int, std::string>> stops;
};

LaunchOptions options_for(const std::string& script, const std::string& log_dir, int nproc, int max_restarts) {
  LaunchOptions o;
  o.nproc_per_node = nproc;
  o.max_restarts = max_restarts;
  o.job_id = "unit";
  o.log_dir = log_dir;
  o.grace_period = 5s;
  o.command = {"/bin/sh", "-c", script};
  return o;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("agent: all workers exit 0 -> finished, coordinator told, logs complete") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  Agent agent(options_for("echo hello from $TRN_RANK of $TRN_WORLD_SIZE", dir.path(), 2, 0), fake, "c:1", signals);
  auto r = agent.run();
  CHECK(r.exit_code == 0);
  CHECK(r.message.empty());
  CHECK(agent.state() == AgentState::kFinished);
  CHECK(fake.finished_generation == 0);
  CHECK(fake.failures.empty());
  CHECK(slurp(log_path(dir.path(), 0, 0)) == "hello from 0 of 2\n");
  CHECK(slurp(log_path(dir.path(), 1, 0)) == "hello from 1 of 2\n");
}

TEST_CASE("agent: a failed worker restarts the group in a new generation while restarts remain") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  // Rank 1 fails in generations 0 and 1; everyone succeeds in generation 2.
  std::string script =
      "echo gen $TRN_GENERATION; if [ $TRN_RANK = 1 ] && [ $TRN_GENERATION -lt 2 ]; then exit 3; fi; "
      "if [ $TRN_RANK = 0 ] && [ $TRN_GENERATION -lt 2 ]; then exec sleep 30; fi";
  SECTION("two restarts allowed: finishes in generation 2") {
    Agent agent(options_for(script, dir.path(), 2, 2), fake, "c:1", signals);
    auto r = agent.run();
    CHECK(r.exit_code == 0);
    CHECK(agent.restarts_used() == 2);
    CHECK(agent.generation() == 2);
    CHECK(fake.joins == 3);
    REQUIRE(fake.failures.size() == 2);
    CHECK(fake.failures[0].first == 1);
    CHECK_THAT(fake.failures[0].second, Catch::Contains("exited with code 3"));
    CHECK(fake.finished_generation == 2);
    // Rank 0 ran in generation 1 too (stopped there, perhaps before it printed).
    CHECK(std::filesystem::exists(log_path(dir.path(), 0, 1)));
    CHECK(slurp(log_path(dir.path(), 1, 2)) == "gen 2\n");
  }
  SECTION("one restart allowed: fails with rank 1's exit code and names it") {
    Agent agent(options_for(script, dir.path(), 2, 1), fake, "c:1", signals);
    auto r = agent.run();
    CHECK(r.exit_code == 3);
    CHECK(agent.state() == AgentState::kFailed);
    CHECK_THAT(r.message, Catch::Contains("rank 1 (local rank 1, pid"));
    CHECK_THAT(r.message, Catch::Contains("exited with code 3 in generation 1; no restarts left (--max-restarts 1)"));
    CHECK(fake.finished_generation == -1);
  }
}

TEST_CASE("agent: when another node moves the generation on, the local group restarts with it") {
  trn::test::TempDir dir;
  FakeControlPlane fake;
  SignalWatcher signals;
  std::string script = "if [ $TRN_GENERATION = 0 ]; then exec sleep 30; fi; echo done $TRN_GENERATION";
  std::thread mover([&] {
    std::this_thread::sleep_for(300ms);
    fake.move_on();
  });
  SECTION("restart allowed") {
    Agent agent(options_for(script, dir.path(), 1, 1), fake, "c:1", signals);
    auto r = agent.run();
    mover.join();
    CHECK(r.exit_code == 0);
    CHECK(agent.generation() == 1);
    CHECK(fake.failures.empty());
    CHECK(slurp(log_path(dir.path(), 0, 1)) == "done 1\n");
  }
  SECTION("no restarts: fails naming the reason") {
    Agent agent(options_for(script, dir.path(), 1, 0), fake, "c:1", signals);
    auto r = agent.run();
    mover.join();
    CHECK(r.exit_code == 1);
    CHECK_THAT(r.message, Catch::Contains("test moved it"));
  }
}
