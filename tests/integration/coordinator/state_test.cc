// trn-coordinator's --state-dir as an operator meets it: a damaged state log stops it at start
// with one line, a crash-torn last record costs only that record, finished jobs expire (and stay
// expired across restarts), and after a restart nobody looks healthy before they heartbeat.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <future>
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
