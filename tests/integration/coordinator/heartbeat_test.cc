// Heartbeats against a real trn-coordinator: a node heartbeat carrying its ranks' heartbeats
// stands for each of them (status, ages, the RPC count), and a worker without a trnrun agent
// heartbeats the coordinator directly.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <stdlib.h>

#include <fstream>
#include <future>
#include <regex>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"
#include "launcher/agent/heartbeat_relay.h"
#include "launcher/client/agent_channel.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/helpers.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

v1::JobStatus job_status(CoordinatorClient& c, const std::string& job) {
  v1::GetStatusRequest req;
  req.set_job_id(job);
  v1::GetStatusResponse resp;
  c.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(20s), "status");
  return resp.jobs(0);
}

// Heartbeats the coordinator answered OK, by how they came: "Heartbeat" (gRPC) or
// "HeartbeatDatagram".
int64_t heartbeat_rpcs(int metrics_port, const std::string& method = "Heartbeat") {
  std::string page = test::http_get(metrics_port, "/metrics");
  std::regex line("trn_coordinator_rpcs_total\\{method=\"" + method + R"(",code="OK"\} (\d+))");
  std::smatch m;
  return std::regex_search(page, m, line) ? std::stoll(m[1].str()) : 0;
}

ForwardedHeartbeat forwarded(int rank, int64_t step, Duration age) {
  ForwardedHeartbeat f;
  f.progress = {rank, "", 2000 + rank, step, 1.5, 512.0 * rank, GridCoordinates{rank % 2, rank / 2, 0}};
  f.age = age;
  return f;
}

}  // namespace

TEST_CASE("one node heartbeat datagram delivers every local rank's progress, coordinates and age") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  auto options = test::client_options(coord);
  options.heartbeat_datagram_wait = 20s;  // a loaded host never sends it over gRPC too
  CoordinatorClient client(options);
  auto j = client.join(test::single_node("nodebeat", 4));
  int64_t before = heartbeat_rpcs(mport);
  std::vector<ForwardedHeartbeat> ranks;
  for (int r = 0; r < 4; ++r) ranks.push_back(forwarded(r, 100 + r, std::chrono::milliseconds(r == 3 ? 2500 : 0)));
  auto reply = client.node_heartbeat("nodebeat", j.generation, 0, ranks, "node-h");
  CHECK_FALSE(reply.abort);
  CHECK(heartbeat_rpcs(mport, "HeartbeatDatagram") == 1);
  CHECK(heartbeat_rpcs(mport) - before == 0);

  auto st = job_status(client, "nodebeat");
  REQUIRE(st.workers_size() == 4);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const auto& w = st.workers(r);
    CHECK(w.step() == 100 + r);
    CHECK(w.pid() == 2000 + r);
    CHECK(w.host() == "node-h");
    CHECK(w.heartbeats() == 1);
    CHECK(w.tokens_per_s() == 512.0 * r);
    CHECK(w.coordinates().dp_rank() == r % 2);
    CHECK(w.coordinates().tp_rank() == r / 2);
  }
  // Rank 3 was last heard 2.5 s before the call: trnctl calls it late at once.
  CHECK(st.workers(3).heartbeat_age_ms() >= 2500);
  CHECK(st.workers(0).heartbeat_age_ms() < st.workers(3).heartbeat_age_ms());
  auto ctl = test::run_all({{{"/bin/sh", "-c",
                              test::bin("trnctl") + " --coordinator " + coord.address() +
                                  " status nodebeat --late 2 --stuck 1000 --dead 2000 --json | /usr/bin/python3 -c "
                                  "'import json,sys; w=json.load(sys.stdin)[\"jobs\"][0][\"workers\"]; "
                                  "print(\"states\", \" \".join(x[\"state\"] for x in w))'"},
                             {}}},
                           30s)[0];
  INFO(ctl.describe());
  CHECK_THAT(ctl.output, Catch::Contains("states healthy healthy healthy late"));

  // A rank of another node (there is none here: world size 4) changes nothing. The datagram gets
  // no answer; over gRPC the coordinator says why.
  CoordinatorClient quick([&] {
    auto o = test::client_options(coord);
    o.heartbeat_datagram_wait = 100ms;
    return o;
  }());
  quick.join(test::single_node("nodebeat", 4));
  try {
    quick.node_heartbeat("nodebeat", j.generation, 0, {forwarded(4, 1, 0s)}, "node-h");
    FAIL("a heartbeat forwarding another node's rank was accepted");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("forwards rank 4, which is not one of its ranks 0..3"));
  }
  CHECK(job_status(client, "nodebeat").workers(0).heartbeats() == 1);
}

TEST_CASE("node heartbeat datagrams with tokens: MACed with the job's token and answered; off, they go over gRPC") {
  test::TempDir dir;
  const std::string token_file = dir.path() + "/token";
  std::ofstream(token_file) << "the-admin-token\n";
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(),
                                 {"--metrics-listen", fmt::format("127.0.0.1:{}", mport), "--token-file", token_file});
  auto options = test::client_options(coord, 20s, "the-admin-token");
  options.heartbeat_datagram_wait = 20s;
  CoordinatorClient client(options);
  auto j = client.join(test::single_node("macbeat", 2));
  REQUIRE(j.job_token.size() == 64);
  CHECK_FALSE(client.node_heartbeat("macbeat", j.generation, 0, {forwarded(0, 5, 0s), forwarded(1, 5, 0s)}, "h").abort);
  CHECK(heartbeat_rpcs(mport, "HeartbeatDatagram") == 1);
  CHECK(heartbeat_rpcs(mport) == 0);
  CHECK(job_status(client, "macbeat").workers(1).step() == 5);

  // TRN_HEARTBEAT_DATAGRAMS=off: the same heartbeat goes as an RPC.
  ::setenv("TRN_HEARTBEAT_DATAGRAMS", "off", 1);
  settings::reload_for_testing();
  CoordinatorClient grpc_only(options);
  ::unsetenv("TRN_HEARTBEAT_DATAGRAMS");
  settings::reload_for_testing();
  grpc_only.join(test::single_node("macbeat", 2));
  CHECK_FALSE(grpc_only.node_heartbeat("macbeat", j.generation, 0, {forwarded(1, 6, 0s)}, "h").abort);
  CHECK(heartbeat_rpcs(mport, "HeartbeatDatagram") == 1);
  CHECK(heartbeat_rpcs(mport) == 1);
  CHECK(job_status(client, "macbeat").workers(1).step() == 6);
}

TEST_CASE("a coordinator started with --no-heartbeat-datagrams names no UDP port; node heartbeats go over gRPC") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport),
                                              "--no-heartbeat-datagrams"});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("grpcbeat", 1));
  CHECK_FALSE(client.node_heartbeat("grpcbeat", j.generation, 0, {forwarded(0, 3, 0s)}, "h").abort);
  CHECK(heartbeat_rpcs(mport) == 1);
  CHECK(heartbeat_rpcs(mport, "HeartbeatDatagram") == 0);
  CHECK(job_status(client, "grpcbeat").workers(0).step() == 3);
}

TEST_CASE("a worker whose TRN_AGENT_SOCKET leads nowhere heartbeats the coordinator directly") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("fallback", 1));
  ::setenv(kAgentSocketEnv, (dir.path() + "/no-agent.sock").c_str(), 1);
  {
    Heartbeater hb(client, "fallback", j.generation, 0, [](const std::string&) {});
    ::unsetenv(kAgentSocketEnv);
    hb.update(33, 2.0, 10);
    auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until &&
           !(job_status(client, "fallback").workers(0).step() == 33 && !hb.via_agent()))
      std::this_thread::sleep_for(100ms);
    CHECK_FALSE(hb.via_agent());
    CHECK(job_status(client, "fallback").workers(0).step() == 33);
  }
}

TEST_CASE("a worker's recovery report reaches the job's status through its agent's relay and node heartbeat") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord));
  auto j = client.join(test::single_node("recovered", 2));
  launch::HeartbeatRelay relay("recovered", dir.path());
  relay.expect(j.generation, 0, 2);
  ::setenv(kAgentSocketEnv, relay.socket_path().c_str(), 1);
  Heartbeater hb(client, "recovered", j.generation, 0, [](const std::string&) {});
  ::unsetenv(kAgentSocketEnv);
  REQUIRE(hb.via_agent());
  hb.update(1201, 2.0, 10);
  hb.set_recovery(RecoveryReport{2, 0.12, 0.30, 0.45, 1200, 0, 3, 1, 0.965});
  // The agent's side: forward what the relay heard until the report arrives.
  auto until = std::chrono::steady_clock::now() + 20s;
  v1::JobStatus st;
  while (std::chrono::steady_clock::now() < until) {
    client.node_heartbeat("recovered", j.generation, 0, relay.take(), "node-h");
    st = job_status(client, "recovered");
    if (st.has_recovery()) break;
    std::this_thread::sleep_for(100ms);
  }
  REQUIRE(st.has_recovery());
  const auto& r = st.recovery();
  CHECK(r.recoveries() == 2);
  CHECK(r.detect_to_generation_s() == 0.12);
  CHECK(r.detect_to_restored_s() == 0.30);
  CHECK(r.detect_to_first_step_s() == 0.45);
  CHECK(r.restored_step() == 1200);
  CHECK(r.steps_lost() == 0);
  CHECK(r.steps_lost_total() == 3);
  CHECK(r.replaced() == 1);
  CHECK(r.goodput() == 0.965);
  CHECK(st.workers(0).step() == 1201);
}
