// Heartbeats under trnrun: the workers hand them to their node's agent, which sends one node
// heartbeat per interval carrying every local rank's; the coordinator still sees, and judges,
// each rank on its own. Real trnrun agents, real workers, a real trn-coordinator.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <signal.h>

#include <fstream>
#include <optional>
#include <regex>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/helpers.h"
#include "tests/integration/launcher/launcher_children.h"

using namespace trn;
using namespace trn::test;
using namespace trn::test::launch;
using namespace std::chrono_literals;

namespace {

std::optional<control::v1::JobStatus> job_status(control::CoordinatorClient& c, const std::string& job) {
  control::v1::GetStatusRequest req;
  req.set_job_id(job);
  control::v1::GetStatusResponse resp;
  try {
    c.impl().call(&control::v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(20s), "status");
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kUsage) return std::nullopt;  // not joined yet
    throw;
  }
  if (resp.jobs_size() != 1) return std::nullopt;
  return resp.jobs(0);
}

// Polls the job's status until pred holds (true) or the deadline passes (false).
template <typename Pred>
bool wait_for_status(control::CoordinatorClient& c, const std::string& job, Pred pred,
                     std::chrono::seconds within = 60s) {
  auto until = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < until) {
    auto st = job_status(c, job);
    if (st && st->state() == "running" && pred(*st)) return true;
    std::this_thread::sleep_for(100ms);
  }
  return false;
}

// Every rank of the job heard from at least `beats` times.
auto all_ranks_have(int world, int64_t beats) {
  return [world, beats](const control::v1::JobStatus& st) {
    if (st.workers_size() != world) return false;
    for (const auto& w : st.workers())
      if (w.heartbeats() < beats) return false;
    return true;
  };
}

int64_t rank_heartbeats(const control::v1::JobStatus& st) {
  int64_t n = 0;
  for (const auto& w : st.workers()) n += w.heartbeats();
  return n;
}

// Heartbeats the coordinator handled, from its /metrics page, by how they came ("Heartbeat":
// gRPC, "HeartbeatDatagram") and answer (a regex of status codes; default every one).
int64_t heartbeat_rpcs(int metrics_port, const std::string& method = "Heartbeat", const std::string& code = "[A-Z_]+") {
  std::string page = http_get(metrics_port, "/metrics");
  std::regex line("trn_coordinator_rpcs_total\\{method=\"" + method + "\",code=\"" + code + R"("\} (\d+))");
  int64_t n = 0;
  for (auto it = std::sregex_iterator(page.begin(), page.end(), line); it != std::sregex_iterator(); ++it)
    n += std::stoll((*it)[1].str());
  return n;
}

control::ClientOptions options(const CoordinatorProcess& c) {
  control::ClientOptions o;
  o.address = c.address();
  o.rpc_timeout = 20s;
  return o;
}

}  // namespace

TEST_CASE("under trnrun each node sends one heartbeat datagram per interval carrying all its ranks' progress") {
  TempDir dir;
  int mport = free_port();
  CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  control::CoordinatorClient client(options(coord));
  const std::string stop = dir.path() + "/stop";
  const int nodes = 2, per_node = 3, world = nodes * per_node;
  std::vector<std::unique_ptr<Process>> agents;
  for (int node = 0; node < nodes; ++node)
    agents.push_back(std::make_unique<Process>(
        ProcSpec{trnrun_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node",
                              std::to_string(per_node), "--coordinator", coord.address(), "--job-id", "hb-nodes"},
                             "heartbeat_worker", {stop}),
                 {{"TRN_HEARTBEAT_INTERVAL", "0.2"}}}));

  // Counted from once every worker is up, so that the agents' heartbeats before their workers
  // started do not count.
  REQUIRE(wait_for_status(client, "hb-nodes", all_ranks_have(world, 3)));
  int64_t rpcs0 = heartbeat_rpcs(mport), datagrams0 = heartbeat_rpcs(mport, "HeartbeatDatagram", "OK");
  int64_t beats0 = rank_heartbeats(*job_status(client, "hb-nodes"));
  REQUIRE(wait_for_status(client, "hb-nodes", all_ranks_have(world, 20)));
  auto st = *job_status(client, "hb-nodes");
  int64_t rpcs = heartbeat_rpcs(mport) - rpcs0;
  int64_t datagrams = heartbeat_rpcs(mport, "HeartbeatDatagram", "OK") - datagrams0;
  int64_t beats = rank_heartbeats(st) - beats0;
  INFO("heartbeat RPCs " << rpcs << ", datagrams " << datagrams << ", rank heartbeats delivered " << beats);
  // Heartbeating directly, every rank heartbeat is an RPC of its own (rpcs >= beats). Through the
  // agents, one node heartbeat carries a node's 3 ranks, as a datagram recorded (OK) or, when its
  // answer is late on a loaded host, as an RPC in its place.
  CHECK(beats >= 2 * (rpcs + datagrams));
  CHECK(datagrams > 0);

  // Every rank's own progress, place in the grid, host and pid, as trnctl status shows it.
  for (int r = 0; r < world; ++r) {
    const auto& w = st.workers(r);
    INFO("rank " << r);
    CHECK(w.rank() == r);
    CHECK(w.step() > 0);
    CHECK(w.tokens_per_s() == 1000.0 * (r + 1));
    REQUIRE(w.has_coordinates());
    CHECK(w.coordinates().dp_rank() == r);
    CHECK(w.pid() > 0);
    CHECK_FALSE(w.host().empty());
    CHECK(w.heartbeat_age_ms() >= 0);
  }
  auto table = run_all({{{bin("trnctl"), "--coordinator", coord.address(), "status", "hb-nodes"}, {}}}, 30s)[0];
  INFO(table.describe());
  CHECK(table.exit_code == 0);
  for (int r = 0; r < world; ++r) CHECK_THAT(table.output, Catch::Contains(fmt::format(" {}/0/0 ", r)));

  std::ofstream(stop) << "stop\n";
  std::string all;
  for (auto& a : agents) {
    auto r = a->wait(std::chrono::steady_clock::now() + 60s);
    INFO(r.describe());
    CHECK(r.exit_code == 0);
    all += r.output;
  }
  for (int r = 0; r < world; ++r)
    CHECK_THAT(all, Catch::Contains(fmt::format("heartbeat_worker rank={} pid=", r)));
  CHECK(all.find("via_agent=0") == std::string::npos);
}

TEST_CASE("a stalled worker under trnrun is reported late, then ends its generation, while its node heartbeats on") {
  TempDir dir;
  CoordinatorProcess coord(dir.path(), {"--heartbeat-timeout", "5"});
  control::CoordinatorClient client(options(coord));
  const std::string stop = dir.path() + "/stop";
  Process agent(ProcSpec{trnrun_argv({"--nproc-per-node", "2", "--coordinator", coord.address(), "--job-id",
                                      "hb-stall", "--max-restarts", "0", "--grace-period", "1"},
                                     "heartbeat_worker", {stop}),
                         {{"TRN_HEARTBEAT_INTERVAL", "0.2"}}});
  REQUIRE(wait_for_status(client, "hb-stall", all_ranks_have(2, 3)));
  pid_t stalled = static_cast<pid_t>(job_status(client, "hb-stall")->workers(1).pid());
  REQUIRE(stalled > 0);
  // The process is alive but does nothing: no progress, no heartbeat.
  REQUIRE(::kill(stalled, SIGSTOP) == 0);
  std::optional<control::v1::JobStatus> late;
  REQUIRE(wait_for_status(client, "hb-stall", [&](const control::v1::JobStatus& st) {
    if (st.workers(1).heartbeat_age_ms() < 1500) return false;
    late = st;
    return true;
  }));
  // Rank 0 keeps heartbeating through the same agent; the node is alive; rank 1 alone ages.
  CHECK(late->workers(0).heartbeat_age_ms() < late->workers(1).heartbeat_age_ms());
  CHECK(late->nodes(0).heartbeat_age_ms() < late->workers(1).heartbeat_age_ms());
  auto ctl = run_all({{{"/bin/sh", "-c",
                        bin("trnctl") + " --coordinator " + coord.address() +
                            " status hb-stall --json --late 1 --stuck 1000 --dead 2000"
                            " | /usr/bin/python3 -c 'import json,sys; w=json.load(sys.stdin)[\"jobs\"][0][\"workers\"];"
                            " print(\"rank1-state\", w[1][\"state\"])'"},
                       {}}},
                     30s)[0];
  INFO(ctl.describe());
  CHECK_THAT(ctl.output, Catch::Contains("rank1-state late"));

  // The coordinator's heartbeat timeout ends the generation, naming the stalled rank; the agent
  // passes the abort on to rank 0, stops the group and (no restarts left) ends.
  auto r = agent.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  CHECK_THAT(r.output, Catch::Contains("the job moved on without this node"));
  CHECK(std::regex_search(r.output, std::regex(fmt::format(R"(rank 1 \([^)]* pid {}\) missed heartbeats)", stalled))));
  CHECK_THAT(r.output, Catch::Contains("on_abort rank=0 reason=rank 1"));
  CHECK(gone(stalled));
}
