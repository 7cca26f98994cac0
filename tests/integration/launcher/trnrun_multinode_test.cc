// Several trnrun agents ("nodes") of one job on this machine, against one real trn-coordinator.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <signal.h>

#include <regex>
#include <thread>

#include "tests/integration/launcher/launcher_children.h"

using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

TEST_CASE("a failure on one node restarts every node's workers in the next generation") {
  Coordinator coordinator;
  std::vector<ProcSpec> nodes;
  for (int node = 0; node < 2; ++node)
    nodes.push_back({trnrun_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                                  "--coordinator", coordinator.address, "--job-id", "two-nodes", "--max-restarts",
                                  "1", "--grace-period", "5"},
                                 "fail_rank", {"3", "7", "1"}),
                     {}});
  auto results = run_all(nodes, 120s);
  std::string all;
  for (const auto& r : results) {
    INFO(r.describe());
    CHECK(r.exit_code == 0);
    all += r.output;
  }
  // Rank 3 failed in generation 0; every rank of both nodes ran again in generation 1.
  INFO(all);
  CHECK(all.find("rank=3 generation=0 ") != std::string::npos);
  for (int rank = 0; rank < 4; ++rank)
    CHECK(all.find(fmt::format("rank={} generation=1 ", rank)) != std::string::npos);
}

TEST_CASE("with no restarts left, a failure on one node ends the job on every node") {
  Coordinator coordinator;
  std::vector<ProcSpec> nodes;
  for (int node = 0; node < 2; ++node)
    nodes.push_back({trnrun_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "1",
                                  "--coordinator", coordinator.address, "--job-id", "fail-all", "--grace-period", "5"},
                                 "fail_rank", {"1", "4", "99"}),
                     {}});
  auto results = run_all(nodes, 120s);
  int failing = -1;
  for (int i = 0; i < 2; ++i) {
    INFO(results[i].describe());
    CHECK_FALSE(results[i].timed_out);
    CHECK(results[i].exit_code != 0);
    if (results[i].output.find("trnrun: rank 1 (local rank 0") != std::string::npos) failing = i;
  }
  REQUIRE(failing >= 0);
  CHECK(results[failing].exit_code == 4);
  CHECK(results[1 - failing].output.find("trnrun: the job moved on without this node") != std::string::npos);
}

TEST_CASE("Ctrl-C while waiting for the other nodes ends trnrun at once") {
  Coordinator coordinator;
  Process p(ProcSpec{trnrun_argv({"--nnodes", "2", "--coordinator", coordinator.address}, "env_report"),
                     {{"TRN_LOG_LEVEL", "debug"}}});
  std::this_thread::sleep_for(500ms);  // let it reach the rendezvous (it waits there either way)
  REQUIRE(p.running());
  p.signal(SIGINT);
  auto r = p.wait(std::chrono::steady_clock::now() + 20s);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == 128 + SIGINT);
  CHECK(r.output.find("trnrun: interrupted by SIGINT; stopped 0 workers") != std::string::npos);
}

TEST_CASE("a restart shows in trnctl status as a new generation with its cause") {
  Coordinator coordinator;
  auto r = run_all({{trnrun_argv({"--nproc-per-node", "2", "--coordinator", coordinator.address, "--job-id",
                                  "visible", "--max-restarts", "2"},
                                 "fail_rank", {"1", "3", "1"}),
                     {}}},
                   60s)[0];
  INFO(r.describe());
  REQUIRE(r.exit_code == 0);
  auto status = run_all({{{bin("trnctl"), "--coordinator", coordinator.address, "status", "visible", "--json"}, {}}},
                        30s)[0];
  INFO(status.describe());
  REQUIRE(status.exit_code == 0);
  CHECK(std::regex_search(status.output, std::regex(R"("generation": 1,)")));
  CHECK(std::regex_search(status.output, std::regex(R"("restarts": 1,)")));
  CHECK(std::regex_search(status.output, std::regex(R"("cause": "[^"]*rank 1 \(local rank 1, pid \d+\) exited with code 3")")));
  CHECK(std::regex_search(status.output, std::regex(R"("state": "completed")")));
}
