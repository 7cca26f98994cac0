// trn-coordinator's --state-dir as an operator meets it: a damaged state log stops it at start
// with one line, a crash-torn last record costs only that record, finished jobs expire (and stay
// expired across restarts), and after a restart nobody looks healthy before they heartbeat.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/helpers.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

// GetStatus of one job; nullopt when the coordinator does not hold it.
std::optional<v1::JobStatus> job_status(CoordinatorClient& c, const std::string& job) {
  v1::GetStatusRequest req;
  req.set_job_id(job);
  v1::GetStatusResponse resp;
  try {
    c.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(20s), "status");
  } catch (const Error& e) {
    if (std::string(e.what()).find("no job") != std::string::npos) return std::nullopt;
    throw;
  }
  return resp.jobs(0);
}

test::ProcResult run(const std::string& cmd) {
  return test::run_all({{{"/bin/sh", "-c", cmd}, {}}}, 30s)[0];
}

// A coordinator that must refuse to start: exit 2 and exactly one line, "trn-coordinator: error: ...".
void check_refused(const std::string& args, const std::string& needle) {
  auto r = run(test::bin("trn-coordinator") + " --listen 127.0.0.1:0 " + args);
  INFO(args << ": " << r.describe());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::StartsWith("trn-coordinator: error: ") && Catch::Contains(needle));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("a state log with a flipped bit, an empty one, or a directory in its place stops trn-coordinator at start") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  {
    test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
    CoordinatorClient client(test::client_options(coord));
    client.join(test::single_node("kept-job"));
    CHECK(coord.terminate().exit_code == 0);
  }
  std::string log = state + "/state.log";
  std::string good = slurp(log);
  REQUIRE(good.size() > 40);
  std::string bad = good;
  bad[good.size() / 2] = static_cast<char>(bad[good.size() / 2] ^ 0x10);
  std::ofstream(log, std::ios::binary | std::ios::trunc) << bad;
  check_refused("--state-dir " + state, "fails its checksum");
  std::ofstream(log, std::ios::binary | std::ios::trunc);  // 0 bytes
  check_refused("--state-dir " + state, "is empty (0 bytes)");
  std::filesystem::remove(log);
  std::filesystem::create_directory(log);
  check_refused("--state-dir " + state, "not a regular file");
  std::filesystem::remove(log);
  std::ofstream(dir.path() + "/plain-file") << "x";
  check_refused("--state-dir " + dir.path() + "/plain-file", "is not a directory");
}

TEST_CASE("a state log whose last record a crash cut short loses that record only, with a warning") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  {
    CoordinatorClient client(test::client_options(coord));
    client.join(test::single_node("first"));
    coord.kill9();
  }
  size_t before = std::filesystem::file_size(state + "/state.log");
  coord.restart_same_port();
  {
    CoordinatorClient client(test::client_options(coord));
    client.join(test::single_node("second"));  // appended after the restart's compaction
    coord.kill9();
  }
  std::filesystem::resize_file(state + "/state.log", std::filesystem::file_size(state + "/state.log") - 5);
  REQUIRE(std::filesystem::file_size(state + "/state.log") > before);
  coord.restart_same_port();
  CoordinatorClient client(test::client_options(coord));
  CHECK(job_status(client, "first"));
  CHECK_FALSE(job_status(client, "second"));
  CHECK_THAT(coord.log(), Catch::Contains("dropped its last record"));
}

TEST_CASE("finished jobs expire after --job-retention and beyond --max-finished-jobs, across restarts") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state, "--job-retention", "2", "--max-finished-jobs", "2"});
  CoordinatorClient client(test::client_options(coord));
  for (const char* job : {"old", "middle", "new"}) {
    auto j = client.join(test::single_node(job));
    client.finish(job, j.generation, 0);
  }
  auto running = client.join(test::single_node("running"));
  auto until = std::chrono::steady_clock::now() + 10s;
  while (job_status(client, "old") && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(50ms);
  CHECK_FALSE(job_status(client, "old"));  // beyond the count: the oldest finished job goes first
  coord.kill9();
  coord.restart_same_port();
  CHECK_FALSE(job_status(client, "old"));  // and stays gone after a restart
  until = std::chrono::steady_clock::now() + 15s;
  while ((job_status(client, "middle") || job_status(client, "new")) && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(100ms);
  CHECK_FALSE(job_status(client, "middle"));
  CHECK_FALSE(job_status(client, "new"));
  auto r = job_status(client, "running");
  REQUIRE(r);
  CHECK(r->state() == "running");
  // A job id that expired is free again.
  CHECK(client.join(test::single_node("old")).world_size == 1);
  (void)running;
}

TEST_CASE("after a coordinator restart, members not heard from since show as unknown, never freshly healthy") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("train", 2));
  client.heartbeat("train", j.generation, {0, "h", 100, 5, 1.0, 10});
  client.heartbeat("train", j.generation, {1, "h", 101, 5, 1.0, 10});
  coord.kill9();
  coord.restart_same_port();
  auto st = job_status(client, "train");
  REQUIRE(st);
  REQUIRE(st->nodes_size() == 1);
  CHECK(st->nodes(0).heartbeat_unknown());
  REQUIRE(st->workers_size() == 2);
  CHECK(st->workers(0).heartbeat_unknown());
  CHECK(st->workers(1).heartbeat_unknown());
  auto ctl = run(test::bin("trnctl") + " --coordinator " + coord.address() + " status train");
  INFO(ctl.describe());
  CHECK(ctl.exit_code == 3);  // unknown is not healthy
  CHECK_THAT(ctl.output, Catch::Contains("unknown"));
  CHECK_THAT(ctl.output, !Catch::Contains(" healthy"));
  client.heartbeat("train", j.generation, {1, "h", 101, 6, 1.0, 10});
  st = job_status(client, "train");
  CHECK(st->workers(0).heartbeat_unknown());  // rank 0 has not been heard from
  CHECK_FALSE(st->workers(1).heartbeat_unknown());
  CHECK(st->workers(1).heartbeat_age_ms() >= 0);
}

TEST_CASE("trnctl status shows each rank's (dp, tp, pp) coordinates from Heartbeater::set_coordinates") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("grid", 2));
  {
    Heartbeater hb0(client, "grid", j.generation, 0, [](const std::string&) {});
    Heartbeater hb1(client, "grid", j.generation, 1, [](const std::string&) {});
    hb0.set_coordinates(0, 0, 0);
    hb1.set_coordinates(1, 0, 0);
    auto until = std::chrono::steady_clock::now() + 15s;
    auto both = [&] {
      auto st = job_status(client, "grid");
      return st && st->workers_size() == 2 && st->workers(0).has_coordinates() && st->workers(1).has_coordinates();
    };
    while (!both() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(100ms);
    REQUIRE(both());
  }
  std::string ctl = test::bin("trnctl") + " --coordinator " + coord.address() + " status grid";
  auto table = run(ctl);
  INFO(table.describe());
  CHECK_THAT(table.output, Catch::Contains("DP/TP/PP"));
  CHECK_THAT(table.output, Catch::Contains(" 1/0/0 "));
  CHECK_THAT(table.output, Catch::Contains(" 0/0/0 "));
  auto json = run(ctl + " --json | /usr/bin/python3 -c 'import json,sys; w=json.load(sys.stdin)[\"jobs\"][0][\"workers\"]; "
                        "assert w[1][\"coordinates\"]=={\"dp\":1,\"tp\":0,\"pp\":0}, w; print(\"coords-ok\")'");
  INFO(json.describe());
  CHECK_THAT(json.output, Catch::Contains("coords-ok"));
}

TEST_CASE("after a coordinator restart, ranks not heard from since show no pid, step or loss, not zeros") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("train", 2));
  client.heartbeat("train", j.generation, {0, "h", 100, 5, 2.5, 10});
  client.heartbeat("train", j.generation, {1, "h", 101, 5, 2.5, 10});
  coord.kill9();
  coord.restart_same_port();
  client.heartbeat("train", j.generation, {1, "h", 4242, 7, 1.25, 10});
  auto table = run(test::bin("trnctl") + " --coordinator " + coord.address() + " status train");
  INFO(table.describe());
  // Rank 0: "-" for pid, step, loss and tokens/s; rank 1 reported again.
  CHECK(std::regex_search(table.output, std::regex(R"(\n  0 +h +- +unknown +unknown +- +- +- +- +-\n)")));
  CHECK(std::regex_search(table.output, std::regex(R"(\n  1 +h +4242 .* 7 +1\.2500 +10 +-\n)")));
  auto json = run(test::bin("trnctl") + " --coordinator " + coord.address() +
                  " status train --json | /usr/bin/python3 -c 'import json,sys; w=json.load(sys.stdin)[\"jobs\"][0]"
                  "[\"workers\"]; print(\"rank0\", w[0][\"pid\"], w[0][\"step\"], w[0][\"loss\"], w[0][\"tokens_per_s\"]);"
                  " print(\"rank1\", w[1][\"pid\"], w[1][\"step\"])'");
  INFO(json.describe());
  CHECK_THAT(json.output, Catch::Contains("rank0 None None None None"));
  CHECK_THAT(json.output, Catch::Contains("rank1 4242 7"));
}

TEST_CASE("a job's run id is kept by its restarts and across a coordinator restart; a new run draws a new one") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  CoordinatorClient client(test::client_options(coord));
  auto g0 = client.join(test::single_node("train"));
  REQUIRE(std::regex_match(g0.run_id, std::regex("[0-9a-f]{16}")));
  client.report_failure("train", g0.generation, 0, "boom");
  auto g1 = client.join(test::single_node("train"));  // the same node re-joins: a restart
  CHECK(g1.generation == 1);
  CHECK(g1.run_id == g0.run_id);
  coord.kill9();
  coord.restart_same_port();
  CHECK(client.join(test::single_node("train")).run_id == g0.run_id);  // a member's repeated join
  auto st = job_status(client, "train");
  REQUIRE(st);
  CHECK(st->run_id() == g0.run_id);
  // Every node of the last generation is gone (their trnruns ended); a new trnrun's node starts
  // a new run under the same job id.
  client.report_failure("train", 1, 0, "boom");
  auto fresh = test::single_node("train");
  fresh.node_id = "n1";
  auto g2 = client.join(fresh);
  CHECK(g2.generation == 2);
  CHECK(std::regex_match(g2.run_id, std::regex("[0-9a-f]{16}")));
  CHECK(g2.run_id != g0.run_id);
}

TEST_CASE("a job stopped by its user shows as stopped across a coordinator restart; a new trnrun may start it again") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  CoordinatorClient client(test::client_options(coord));
  auto g0 = client.join(test::single_node("train"));
  client.report_stop("train", g0.generation, 0, "node 0 interrupted by SIGINT");
  coord.kill9();
  coord.restart_same_port();
  auto ctl = run(test::bin("trnctl") + " --coordinator " + coord.address() + " status train");
  INFO(ctl.describe());
  CHECK(ctl.exit_code == 0);
  CHECK_THAT(ctl.output, Catch::Contains("job train  generation 0  stopped  world size 0  nodes 0  restarts 0\n"));
  CHECK_THAT(ctl.output, Catch::Contains("stopped by its user: node 0 interrupted by SIGINT"));
  // The stopped run's own node is told it stopped; another node starts a new run.
  try {
    client.join(test::single_node("train"));
    FAIL("a node of the stopped run joined it again");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("was stopped by its user"));
  }
  auto fresh = test::single_node("train");
  fresh.node_id = "n1";
  auto g1 = client.join(fresh);
  CHECK(g1.generation == 1);
  CHECK(g1.run_id != g0.run_id);
  CHECK(job_status(client, "train")->restarts() == 0);
}
