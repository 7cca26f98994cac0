// trnctl against a real coordinator with a live job: the table, valid JSON, exit codes, events.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <future>
#include <thread>

#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/coordinator_process.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

test::ProcResult trnctl(const std::string& args) {
  auto rs = test::run_all({{{"/bin/sh", "-c", test::bin("trnctl") + " " + args}, {}}}, std::chrono::seconds(30));
  return rs[0];
}

// A two-node job "train" (2 ranks each) with progress from every rank and one committed step.
struct LiveJob {
  test::TempDir dir;
  test::CoordinatorProcess coord{dir.path(), {}};
  CoordinatorClient client{[&] {
    ClientOptions o;
    o.address = coord.address();
    return o;
  }()};
  JoinResult a, b;

  LiveJob() {
    auto join = [&](const std::string& id) {
      JoinRequest r;
      r.job_id = "train";
      r.node_id = id;
      r.host = fmt::format("node-{}", id);
      r.nproc_per_node = 2;
      r.min_nodes = r.max_nodes = 2;
      r.deadline = Deadline::after(20s);
      return client.join(r);
    };
    auto fa = std::async(std::launch::async, join, "a");
    auto fb = std::async(std::launch::async, join, "b");
    a = fa.get();
    b = fb.get();
    for (int r = 0; r < 4; ++r) {
      WorkerProgress p{r, r < 2 ? "node-a" : "node-b", 1000 + r, 120, 2.5 - 0.1 * r, 4096.0};
      if (r == 0) p.val_loss = 2.75;  // the others never validated: "-"
      client.heartbeat("train", 0, p);
      client.report_shard("train", 0, {100, r, fmt::format("/ckpt/step100/rank{}", r), 1024, ""});
    }
  }
};

const char* kCheckJson =
    " | /usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); j=d[\"jobs\"][0]; "
    "assert j[\"job_id\"]==\"train\" and j[\"generation\"]==0 and j[\"world_size\"]==4, j; "
    "assert len(j[\"workers\"])==4 and j[\"workers\"][3][\"step\"]==120 and "
    "j[\"workers\"][3][\"pid\"]==1003, j; "
    "assert j[\"workers\"][0][\"val_loss\"]==2.75 and j[\"workers\"][1][\"val_loss\"] is None, j; "
    "assert j[\"last_committed_step\"]==100 and j[\"checkpoints\"][0][\"shard_count\"]==4, j; "
    "assert j[\"checkpoints\"][0][\"total_bytes\"]==4096, j; "
    "assert j[\"recovery\"] is None, j; "
    "print(\"json-ok\", j[\"healthy\"], j[\"workers\"][0][\"state\"])'";

}  // namespace

TEST_CASE("trnctl status prints a readable table and valid JSON for a live job") {
  LiveJob job;
  std::string co = "--coordinator " + job.coord.address();
  auto t = trnctl("status " + co);
  INFO(t.describe());
  CHECK(t.exit_code == 0);
  CHECK_THAT(t.output, Catch::Contains("job train  generation 0  running  HEALTHY"));
  CHECK_THAT(t.output, Catch::Contains("last committed checkpoint: step 100"));
  CHECK_THAT(t.output, Catch::Contains("RANK") && Catch::Contains("TOKENS/S") && Catch::Contains("node-b"));
  CHECK_THAT(t.output, Catch::Contains("healthy"));
  CHECK_THAT(t.output, Catch::Contains("VAL_LOSS") && Catch::Contains(" 2.7500\n"));

  auto j = trnctl("status train --json " + co + kCheckJson);
  INFO(j.describe());
  CHECK(j.exit_code == 0);
  CHECK_THAT(j.output, Catch::Contains("json-ok True healthy"));

  auto c = trnctl("checkpoints train " + co);
  CHECK(c.exit_code == 0);
  CHECK_THAT(c.output, Catch::Contains("/ckpt/step100/rank0"));
  auto cj = trnctl("checkpoints train --json " + co + " | /usr/bin/python3 -m json.tool");
  CHECK(cj.exit_code == 0);
}

TEST_CASE("trnctl exit codes: unhealthy job 3, no such job 4, unreachable 1, usage 2") {
  LiveJob job;
  std::string co = "--coordinator " + job.coord.address();
  std::this_thread::sleep_for(1200ms);
  auto late = trnctl("status train --late 0.5 --stuck 0.8 --dead 100 " + co);
  INFO(late.describe());
  CHECK(late.exit_code == 3);
  CHECK_THAT(late.output, Catch::Contains("UNHEALTHY") && Catch::Contains("stuck"));
  auto missing = trnctl("status nope " + co);
  CHECK(missing.exit_code == 4);
  CHECK_THAT(missing.output, Catch::Contains("no job 'nope'"));
  auto down = trnctl("status --timeout 1 --coordinator 127.0.0.1:1");
  CHECK(down.exit_code == 1);
  CHECK_THAT(down.output, Catch::Contains("unreachable"));
  auto usage = trnctl("stat " + co);
  CHECK(usage.exit_code == 2);
  CHECK_THAT(usage.output, Catch::Contains("unknown command 'stat'"));
  CHECK(trnctl("status --late x " + co).exit_code == 2);
}

TEST_CASE("trnctl watch streams a job's events") {
  LiveJob job;
  std::string co = "--coordinator " + job.coord.address();
  // Replayed: JOINED a, JOINED b, GENERATION_STARTED, CHECKPOINT_COMMITTED; then a live failure.
  auto w = std::async(std::launch::async, [&] { return trnctl("watch train --count 6 " + co); });
  std::this_thread::sleep_for(1s);
  job.client.report_failure("train", 0, 2, "worker exited with signal 9");
  auto r = w.get();
  INFO(r.describe());
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("GENERATION_STARTED") && Catch::Contains("CHECKPOINT_COMMITTED"));
  CHECK_THAT(r.output, Catch::Contains("FAILURE rank 2 failed: worker exited with signal 9"));
  CHECK_THAT(r.output, Catch::Contains("GENERATION_ENDED"));
  auto j = trnctl("watch train --count 1 --json " + co + " | /usr/bin/python3 -m json.tool");
  CHECK(j.exit_code == 0);
  CHECK_THAT(j.output, Catch::Contains("\"kind\": \"JOINED\""));
}

TEST_CASE("trnctl status and watch show a job's in-place recoveries as rank 0 reports them") {
  LiveJob job;
  std::string co = "--coordinator " + job.coord.address();
  CHECK_THAT(trnctl("status train " + co).output, !Catch::Contains("recoveries"));
  WorkerProgress p{0, "node-a", 1000, 1201, 2.4, 4096.0};
  p.recovery = RecoveryReport{1, 0.12, 0.3, 0.45, 1200, 0, 0, 1, 0.965};
  // Live only: the one event of the recovery, as it happens.
  auto w = std::async(std::launch::async, [&] { return trnctl("watch train --no-replay --count 1 " + co); });
  std::this_thread::sleep_for(1s);
  job.client.heartbeat("train", 0, p);
  job.client.heartbeat("train", 0, p);  // the same count again: no second event
  p.recovery->recoveries = 2;
  p.recovery->replaced = 2;
  p.recovery->steps_lost = p.recovery->steps_lost_total = 3;
  p.recovery->goodput = 0.9;
  job.client.heartbeat("train", 0, p);
  auto r = w.get();
  INFO(r.describe());
  CHECK(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains(" train gen 0 RECOVERED recovery 1 in generation 0: 0.45 s to the next step, "
                                       "0 steps lost, 1 process replaced\n"));
  auto replay = trnctl("watch train --count 6 " + co);
  INFO(replay.describe());
  CHECK_THAT(replay.output, Catch::Contains("RECOVERED recovery 1 in generation 0") &&
                                Catch::Contains("RECOVERED recovery 2 in generation 0: 0.45 s to the next step, 3 steps "
                                                "lost, 2 processes replaced"));

  // Only rank 0 heartbeats here: the others' ages grow, so the thresholds are far beyond how
  // long a loaded machine (or a sanitizer build) takes to get this far.
  auto t = trnctl("status train --late 300 --stuck 300 --dead 300 " + co);
  INFO(t.describe());
  CHECK(t.exit_code == 0);
  CHECK_THAT(t.output, Catch::Contains("\n  recoveries 2 (last: 0.45 s to the next step, 3 steps lost, 2 processes "
                                       "replaced; restored step 1200, new generation 0.12 s, state restored 0.30 s) | "
                                       "steps lost 3 | goodput 90.0%\n"));
  auto j = trnctl("status train --json " + co +
                  " | /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin)[\"jobs\"][0][\"recovery\"]; "
                  "assert r=={\"recoveries\": 2, \"detect_to_generation_s\": 0.12, \"detect_to_restored_s\": 0.3, "
                  "\"detect_to_first_step_s\": 0.45, \"restored_step\": 1200, \"steps_lost\": 3, "
                  "\"steps_lost_total\": 3, \"replaced\": 2, \"goodput\": 0.9}, r; print(\"recovery-ok\")'");
  INFO(j.describe());
  CHECK(j.exit_code == 0);
  CHECK_THAT(j.output, Catch::Contains("recovery-ok"));
}

TEST_CASE(
    "trnctl status of a job of 100000 ranks fits a screen and names the silent ranks; --ranks and --json "
    "page every rank") {
  namespace v1 = coordinator::v1;
  test::TempDir dir;
  test::CoordinatorProcess coord{dir.path(), {"--heartbeat-timeout", "300"}};
  ClientOptions o;
  o.address = coord.address();
  CoordinatorClient client(o);
  constexpr int kNodes = 25, kProcs = 4000;  // 100,000 ranks
  std::vector<std::future<JoinResult>> joins;
  for (int n = 0; n < kNodes; ++n)
    joins.push_back(std::async(std::launch::async, [&, n] {
      JoinRequest r;
      r.job_id = "huge";
      r.node_id = fmt::format("node-{:02}", n);
      r.host = fmt::format("host-{:02}", n);
      r.nproc_per_node = kProcs;
      r.min_nodes = r.max_nodes = kNodes;
      r.deadline = Deadline::after(60s);
      return client.join(r);
    }));
  for (auto& j : joins) REQUIRE(j.get().world_size == kNodes * kProcs);
  // Every node forwards its ranks; rank 12345 was last heard 200 s ago (stuck at --stuck 100),
  // rank 777 90 s ago (late at --late 60); the others just now, healthy for a minute however slow
  // this machine runs the checks.
  for (int n = 0; n < kNodes; ++n) {
    v1::HeartbeatRequest req;
    req.set_job_id("huge");
    req.set_kind(v1::HeartbeatRequest::NODE);
    req.set_rank(n);
    req.set_host(fmt::format("host-{:02}", n));
    for (int i = 0; i < kProcs; ++i) {
      const int rank = n * kProcs + i;
      auto* e = req.add_ranks();
      e->set_rank(rank);
      e->set_pid(10000 + rank);
      e->set_step(500);
      e->set_loss(3.0);
      e->set_tokens_per_s(100);
      e->set_age_ms(rank == 12345 ? 200000 : rank == 777 ? 90000 : 0);
    }
    v1::HeartbeatResponse resp;
    client.impl().call(&v1::Coordinator::Stub::Heartbeat, req, &resp, Deadline::after(20s), "heartbeat");
  }
  const std::string co = " --coordinator " + coord.address();

  const std::string thresholds = " --late 60 --stuck 100 --dead 280";
  auto s = trnctl("status huge" + thresholds + co);
  INFO(s.describe());
  CHECK(s.exit_code == 3);  // two ranks need attention
  CHECK(std::count(s.output.begin(), s.output.end(), '\n') < 25);
  CHECK_THAT(s.output, Catch::Contains("world size 100000  nodes 25"));
  CHECK_THAT(s.output, Catch::Contains("nodes: 25 healthy"));
  CHECK_THAT(s.output, Catch::Contains("ranks: 99998 healthy, 1 late, 1 stuck"));
  CHECK_THAT(
      s.output,
      Catch::Contains("progress: step 500, mean loss 3.0000, 10000000 tokens/s (100000 ranks reporting)"));
  CHECK_THAT(s.output, Catch::Contains("needing attention (the longest silent first): 2 ranks\n"));
  // The longest silent first, with its host and pid.
  const auto stuck = s.output.find("  12345 host-03"), late = s.output.find("  777   host-00");
  CHECK(stuck != std::string::npos);
  CHECK(late != std::string::npos);
  CHECK(stuck < late);
  CHECK_THAT(s.output, Catch::Contains("22345") && Catch::Contains("stuck"));
  CHECK_THAT(s.output, Catch::Contains("trnctl status --ranks huge"));

  // --ranks: every node and rank, fetched page by page (pages of 16,384 ranks).
  auto all = trnctl("status huge --ranks" + thresholds + co + " | grep -c '^  [0-9]'");
  INFO(all.describe());
  CHECK(all.output == std::to_string(kNodes + kNodes * kProcs) + "\n");
  // --json: the same, once each, in order.
  auto js = trnctl("status huge --json" + thresholds + co +
                   " | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin)[\"jobs\"][0]; "
                   "r=[w[\"rank\"] for w in j[\"workers\"]]; n=[x[\"node_rank\"] for x in j[\"nodes\"]]; "
                   "assert r==list(range(100000)), len(r); assert n==list(range(25)), n; "
                   "assert j[\"rank_health\"][\"healthy\"]==99998, j[\"rank_health\"]; print(\"json-ok\")'");
  INFO(js.describe());
  CHECK_THAT(js.output, Catch::Contains("json-ok"));
}
