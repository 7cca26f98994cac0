// trnrun and its coordinator under the things a user or an operator does: a second trnrun given
// a running job's id, the embedded coordinator killed, a stopped (SIGSTOP) worker, Ctrl-C, and
// the run identity every worker gets. Real trnrun, trn-coordinator and trnctl processes.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "tests/integration/coordinator/coordinator_process.h"
#include "tests/integration/launcher/launcher_children.h"

using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

namespace {

// Waits until p's output contains needle (true) or within passes (false).
bool wait_for_output(Process& p, const std::string& needle, std::chrono::seconds within = 30s) {
  auto until = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < until) {
    if (p.output_so_far().find(needle) != std::string::npos) return true;
    if (!p.running()) return p.output_so_far().find(needle) != std::string::npos;
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

// The pid of parent's child process named comm, or -1.
pid_t child_named(pid_t parent, const std::string& comm) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    auto open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    long ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && stat.substr(open + 1, close - open - 1) == comm) return static_cast<pid_t>(std::stol(name));
  }
  return -1;
}

ProcResult trnctl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin("trnctl")};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_all({{argv, {}}}, 30s)[0];
}

// What the run_id_report workers printed: the run ids seen, and "rank/generation" of each line.
struct RunIds {
  std::set<std::string> ids;
  std::set<std::string> seen;  // "R/G"
  void add(const std::string& output) {
    std::regex re(R"(\] rank=(\d+) generation=(\d+) run_id=(\S+))");
    for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it) {
      seen.insert((*it)[1].str() + "/" + (*it)[2].str());
      ids.insert((*it)[3].str());
    }
  }
  // The failing rank reported in generation 0 (the others may be stopped before they print),
  // and every rank in generation 1.
  bool complete(int world, int failing) const {
    if (!seen.count(std::to_string(failing) + "/0")) return false;
    for (int r = 0; r < world; ++r)
      if (!seen.count(std::to_string(r) + "/1")) return false;
    return true;
  }
};

const std::regex kRunId("[0-9a-f]{16}");

}  // namespace

TEST_CASE("a second trnrun given the id of a running fixed-size job fails at once with one line") {
  Coordinator coordinator;
  TempDir dir;
  const std::string stop = dir.path() + "/stop";
  Process first(ProcSpec{trnrun_argv({"--coordinator", coordinator.address, "--job-id", "dup"}, "heartbeat_worker",
                                     {stop, "obey-sigterm"}),
                         {}});
  REQUIRE(wait_for_output(first, "heartbeat_worker rank=0"));
  // Its --join-timeout is far beyond the test's limit: only a prompt refusal passes.
  auto second = run_all({{trnrun_argv({"--coordinator", coordinator.address, "--job-id", "dup", "--join-timeout",
                                       "300"},
                                      "env_report"),
                          {}}},
                        60s)[0];
  INFO(second.describe());
  CHECK_FALSE(second.timed_out);
  CHECK(second.exit_code == 2);
  CHECK_THAT(second.output, Catch::Contains("job 'dup' is already running (generation 0, all 1 of its 1 node)"));
  CHECK_THAT(second.output, Catch::Contains("give this run another job id"));
  CHECK(second.output.find("[rank") == std::string::npos);  // started no worker
  // The running job is untouched.
  std::ofstream(stop) << "stop\n";
  auto r = first.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK(r.exit_code == 0);
}

TEST_CASE("a second trnrun joining a running elastic job that has room says at once that it waits for the next round") {
  Coordinator coordinator;
  TempDir dir;
  const std::string stop = dir.path() + "/stop";
  auto agent = [&] {
    return std::make_unique<Process>(ProcSpec{
        trnrun_argv({"--nnodes", "1:2", "--coordinator", coordinator.address, "--job-id", "grow", "--max-restarts", "1"},
                    "heartbeat_worker", {stop, "obey-sigterm"}),
        {}});
  };
  auto first = agent();
  REQUIRE(wait_for_output(*first, "heartbeat_worker rank=0"));
  auto second = agent();
  INFO(second->output_so_far());
  CHECK(wait_for_output(*second, "job grow is already running generation 0 on 1 of at most 2 nodes: this node joins it"));
  // The job grows to two nodes in generation 1.
  CHECK(wait_for_output(*second, "heartbeat_worker rank=", 60s));
  std::ofstream(stop) << "stop\n";
  for (auto* p : {first.get(), second.get()}) {
    auto r = p->wait(std::chrono::steady_clock::now() + 60s);
    INFO(r.describe());
    CHECK(r.exit_code == 0);
  }
}

TEST_CASE("trnrun ends the job at once, in one line, when its embedded coordinator is killed") {
  TempDir dir;
  const std::string stop = dir.path() + "/stop";
  // TRN_TIMEOUT far beyond the test's limit: waiting for the coordinator to come back fails.
  Process p(ProcSpec{trnrun_argv({"--nproc-per-node", "2", "--max-restarts", "3"}, "heartbeat_worker",
                                 {stop, "obey-sigterm"}),
                     {{"TRN_TIMEOUT", "600"}}});
  REQUIRE(wait_for_output(p, "heartbeat_worker rank=1"));
  REQUIRE(wait_for_output(p, "heartbeat_worker rank=0"));
  pid_t coordinator = child_named(p.pid(), "trn-coordinator");
  REQUIRE(coordinator > 0);
  auto workers = numbers_after(p.output_so_far(), "pid");
  REQUIRE(::kill(coordinator, SIGKILL) == 0);
  auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.output, Catch::Contains(fmt::format("trnrun: the embedded trn-coordinator (pid {}) was killed by signal "
                                                   "9 (SIGKILL) in generation 0; stopped 2 workers",
                                                   coordinator)));
  for (pid_t w : workers) CHECK(gone(w));
}

TEST_CASE("a stopped (SIGSTOP) worker is killed at once when its group stops, not after the grace period") {
  TempDir dir;
  CoordinatorProcess coord(dir.path(), {"--heartbeat-timeout", "2"});
  const std::string stop = dir.path() + "/stop";
  // A grace period far beyond the test's limit: only a stopped worker killed at once passes.
  Process agent(ProcSpec{trnrun_argv({"--nproc-per-node", "2", "--coordinator", coord.address(), "--job-id",
                                      "frozen", "--grace-period", "300"},
                                     "heartbeat_worker", {stop, "obey-sigterm"}),
                         {{"TRN_HEARTBEAT_INTERVAL", "0.2"}}});
  REQUIRE(wait_for_output(agent, "heartbeat_worker rank=1"));
  REQUIRE(wait_for_output(agent, "heartbeat_worker rank=0"));
  auto pids = numbers_after(agent.output_so_far(), "pid");
  std::regex rank1(R"(heartbeat_worker rank=1 pid=(\d+))");
  std::smatch m;
  std::string out = agent.output_so_far();
  REQUIRE(std::regex_search(out, m, rank1));
  pid_t frozen = static_cast<pid_t>(std::stol(m[1].str()));
  // Both ranks reporting first keeps this test to what it is named for: the stopped worker's
  // SIGKILL. (Stopped before its first heartbeat, rank 1 is found through its agent's silent
  // entry instead: registry and relay unit tests.)
  bool heard = false;
  for (auto until = std::chrono::steady_clock::now() + 30s; !heard && std::chrono::steady_clock::now() < until;) {
    heard = trnctl({"--coordinator", coord.address(), "status", "frozen"}).output.find("(2 ranks reporting)") !=
            std::string::npos;
    if (!heard) std::this_thread::sleep_for(100ms);
  }
  REQUIRE(heard);
  REQUIRE(::kill(frozen, SIGSTOP) == 0);
  auto r = agent.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.output, Catch::Contains(fmt::format("missed heartbeats")));
  CHECK_THAT(r.output,
             Catch::Contains(fmt::format("rank 1 (pid {}) is stopped and cannot act on SIGTERM; sending SIGKILL now", frozen)));
  CHECK(gone(frozen));
}

TEST_CASE("Ctrl-C on trnrun shows the job as stopped at the coordinator: no restart counted, trnctl exit 0") {
  Coordinator coordinator;
  TempDir dir;
  const std::string stop = dir.path() + "/stop";
  Process p(ProcSpec{trnrun_argv({"--nproc-per-node", "2", "--coordinator", coordinator.address, "--job-id", "ctrlc",
                                  "--max-restarts", "2"},
                                 "heartbeat_worker", {stop, "obey-sigterm"}),
                     {}});
  REQUIRE(wait_for_output(p, "heartbeat_worker rank=1"));
  REQUIRE(wait_for_output(p, "heartbeat_worker rank=0"));
  p.signal(SIGINT);
  auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK(r.exit_code == 128 + SIGINT);
  auto st = trnctl({"--coordinator", coordinator.address, "status", "ctrlc"});
  INFO(st.describe());
  CHECK(st.exit_code == 0);
  CHECK_THAT(st.output, Catch::Contains("job ctrlc  generation 0  stopped  world size 0  nodes 0  restarts 0"));
  CHECK_THAT(st.output, Catch::Contains("stopped by its user: node 0 interrupted by SIGINT"));
  CHECK_THAT(st.output, !Catch::Contains("UNHEALTHY"));
  auto js = trnctl({"--coordinator", coordinator.address, "status", "ctrlc", "--json"});
  INFO(js.describe());
  CHECK(js.exit_code == 0);
  CHECK_THAT(js.output, Catch::Contains(R"("state": "stopped")") && Catch::Contains(R"("restarts": 0,)"));
  // A new trnrun may run the job id again, as a new run.
  auto again = run_all({{trnrun_argv({"--coordinator", coordinator.address, "--job-id", "ctrlc"}, "run_id_report",
                                     {"0", "0", "0"}),
                         {}}},
                       60s)[0];
  INFO(again.describe());
  CHECK(again.exit_code == 0);
}

TEST_CASE("Ctrl-C on one node of a job stops every node, none re-joins though restarts remain") {
  Coordinator coordinator;
  TempDir dir;
  const std::string stop = dir.path() + "/stop";
  std::vector<std::unique_ptr<Process>> nodes;
  for (int node = 0; node < 2; ++node)
    nodes.push_back(std::make_unique<Process>(ProcSpec{
        trnrun_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--coordinator", coordinator.address,
                     "--job-id", "stop2", "--max-restarts", "3"},
                    "heartbeat_worker", {stop, "obey-sigterm"}),
        {{"TRN_HEARTBEAT_INTERVAL", "0.2"}}}));
  for (auto& n : nodes) REQUIRE(wait_for_output(*n, "heartbeat_worker rank="));
  nodes[0]->signal(SIGINT);
  auto r0 = nodes[0]->wait(std::chrono::steady_clock::now() + 60s);
  auto r1 = nodes[1]->wait(std::chrono::steady_clock::now() + 60s);
  INFO(r0.describe() << "\n" << r1.describe());
  CHECK(r0.exit_code == 128 + SIGINT);
  CHECK_FALSE(r1.timed_out);
  CHECK(r1.exit_code == 1);
  CHECK_THAT(r1.output, Catch::Contains("trnrun: the job was stopped by its user: node 0 interrupted by SIGINT; "
                                        "stopped 1 worker on this node too"));
  CHECK(r1.output.find("generation=1") == std::string::npos);
  auto st = trnctl({"--coordinator", coordinator.address, "status", "stop2"});
  INFO(st.describe());
  CHECK(st.exit_code == 0);
  CHECK_THAT(st.output, Catch::Contains("stopped") && Catch::Contains("restarts 0"));
}

TEST_CASE("every worker of a run gets one TRN_RUN_ID, kept by restarts; a new run gets a new one; a user's is kept") {
  auto once = [](std::map<std::string, std::string> env) {
    auto r = run_all({{trnrun_argv({"--nproc-per-node", "2", "--max-restarts", "1"}, "run_id_report", {"1", "3", "1"}),
                       std::move(env)}},
                     60s)[0];
    INFO(r.describe());
    CHECK(r.exit_code == 0);
    RunIds ids;
    ids.add(r.output);
    CHECK(ids.complete(2, 1));
    REQUIRE(ids.ids.size() == 1);  // one id for both ranks and both generations
    return *ids.ids.begin();
  };
  auto first = once({});
  CHECK(std::regex_match(first, kRunId));
  auto second = once({});
  CHECK(std::regex_match(second, kRunId));
  CHECK(second != first);
  CHECK(once({{"TRN_RUN_ID", "requeue-7"}}) == "requeue-7");
}

TEST_CASE("the nodes of a job agree on its TRN_RUN_ID, across a restart") {
  Coordinator coordinator;
  std::vector<ProcSpec> nodes;
  for (int node = 0; node < 2; ++node)
    nodes.push_back({trnrun_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
                                  "--coordinator", coordinator.address, "--job-id", "agree", "--max-restarts", "1"},
                                 "run_id_report", {"3", "7", "1"}),
                     {}});
  auto results = run_all(nodes, 90s);
  RunIds ids;
  for (const auto& r : results) {
    INFO(r.describe());
    CHECK(r.exit_code == 0);
    ids.add(r.output);
  }
  CHECK(ids.complete(4, 3));
  REQUIRE(ids.ids.size() == 1);  // one id on both nodes, for every rank and generation
  CHECK(std::regex_match(*ids.ids.begin(), kRunId));
}
