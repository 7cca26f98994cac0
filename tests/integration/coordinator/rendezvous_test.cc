// Rendezvous and generations against a real trn-coordinator on loopback.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <atomic>
#include <future>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "tests/integration/coordinator/coordinator_process.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

JoinRequest node(const std::string& job, const std::string& id, int min, int max, int nproc = 2,
                 Duration timeout = 20s) {
  JoinRequest r;
  r.job_id = job;
  r.node_id = id;
  r.host = fmt::format("host-{}", id);
  r.nproc_per_node = nproc;
  r.min_nodes = min;
  r.max_nodes = max;
  r.settle = 300ms;
  r.deadline = Deadline::after(timeout);
  return r;
}

ClientOptions opts(const test::CoordinatorProcess& c) {
  ClientOptions o;
  o.address = c.address();
  o.rpc_timeout = 10s;
  return o;
}

}  // namespace

TEST_CASE("rendezvous assigns ranks by node id, and a duplicate joiner gets the same answer") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(opts(coord));
  // Join order c, a, b (and a twice); ranks follow node ids a < b < c.
  auto fc = std::async(std::launch::async, [&] { return client.join(node("j", "c", 3, 3, 1)); });
  std::this_thread::sleep_for(100ms);
  auto fa1 = std::async(std::launch::async, [&] { return client.join(node("j", "a", 3, 3, 2)); });
  auto fa2 = std::async(std::launch::async, [&] { return client.join(node("j", "a", 3, 3, 2)); });
  std::this_thread::sleep_for(100ms);
  auto fb = std::async(std::launch::async, [&] { return client.join(node("j", "b", 3, 3, 4)); });
  auto a1 = fa1.get(), a2 = fa2.get(), b = fb.get(), c = fc.get();
  CHECK(a1.generation == 0);
  CHECK(a1.nnodes == 3);
  CHECK(a1.world_size == 7);
  CHECK(a1.node_rank == 0);
  CHECK(a2.node_rank == 0);
  CHECK(a1.rank_offset == 0);
  CHECK(b.node_rank == 1);
  CHECK(b.rank_offset == 2);
  CHECK(c.node_rank == 2);
  CHECK(c.rank_offset == 6);
  REQUIRE(c.nodes.size() == 3);
  CHECK(c.nodes[1].node_id == "b");
  CHECK(c.nodes[1].host == "host-b");
  CHECK(c.nodes[1].nproc == 4);
  // A member joining again in the same generation (a lost reply, retried) gets the same answer.
  auto again = client.join(node("j", "b", 3, 3, 4));
  CHECK(again.generation == 0);
  CHECK(again.node_rank == 1);
}

TEST_CASE("rendezvous completes at min_nodes after the settle time, and a late joiner starts a new generation") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(opts(coord));
  auto f0 = std::async(std::launch::async, [&] { return client.join(node("j", "n0", 2, 3)); });
  auto f1 = std::async(std::launch::async, [&] { return client.join(node("j", "n1", 2, 3)); });
  auto r0 = f0.get(), r1 = f1.get();
  CHECK(r0.nnodes == 2);
  CHECK(r0.generation == 0);
  CHECK(client.node_heartbeat("j", 0, r0.node_rank).abort == false);

  // A third node arrives while generation 0 runs with room for it: generation 0 ends.
  auto f2 = std::async(std::launch::async, [&] { return client.join(node("j", "n2", 2, 3)); });
  HeartbeatReply hb;
  for (int i = 0; i < 100 && !hb.abort; ++i) {
    hb = client.node_heartbeat("j", 0, r0.node_rank);
    if (!hb.abort) std::this_thread::sleep_for(50ms);
  }
  REQUIRE(hb.abort);
  CHECK(hb.generation == 1);
  CHECK_THAT(hb.reason, Catch::Contains("membership change") && Catch::Contains("n2"));
  // The old members re-join; all three form generation 1.
  auto g0 = std::async(std::launch::async, [&] { return client.join(node("j", "n0", 2, 3)); });
  auto g1 = std::async(std::launch::async, [&] { return client.join(node("j", "n1", 2, 3)); });
  auto s2 = f2.get();
  CHECK(s2.generation == 1);
  CHECK(s2.nnodes == 3);
  CHECK(s2.world_size == 6);
  CHECK(g0.get().node_rank == 0);
  CHECK(g1.get().node_rank == 1);
  CHECK(s2.node_rank == 2);
}

TEST_CASE("rendezvous that never reaches min_nodes times out with a clear message") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(opts(coord));
  try {
    client.join(node("j", "lonely", 2, 2, 1, 1s));
    FAIL("join returned without the second node");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kTimeout);
    CHECK_THAT(e.what(), Catch::Contains("1 of min 2 nodes"));
  }
  // The timed-out node left the round: a later pair forms generation 0 by itself.
  auto fa = std::async(std::launch::async, [&] { return client.join(node("j", "x", 2, 2)); });
  auto fb = std::async(std::launch::async, [&] { return client.join(node("j", "y", 2, 2)); });
  CHECK(fa.get().nnodes == 2);
  CHECK(fb.get().world_size == 4);
}

TEST_CASE("a worker that stops heartbeating starts a new generation and the others are told") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {"--heartbeat-timeout", "1"});
  CoordinatorClient client(opts(coord));
  auto fa = std::async(std::launch::async, [&] { return client.join(node("j", "a", 2, 2, 1)); });
  auto fb = std::async(std::launch::async, [&] { return client.join(node("j", "b", 2, 2, 1)); });
  auto a = fa.get();
  fb.get();
  WorkerProgress p0{0, "h0", 100, 5, 2.5, 1000};
  WorkerProgress p1{1, "h1", 101, 5, 2.5, 1000};
  client.heartbeat("j", a.generation, p0);
  client.heartbeat("j", a.generation, p1);
  // Rank 1 goes silent; rank 0 (and its node) keep heartbeating.
  HeartbeatReply hb;
  auto until = Clock::now() + 15s;
  while (!hb.abort && Clock::now() < until) {
    std::this_thread::sleep_for(200ms);
    hb = client.heartbeat("j", a.generation, p0);
    client.node_heartbeat("j", a.generation, 0);
    client.node_heartbeat("j", a.generation, 1);
  }
  REQUIRE(hb.abort);
  CHECK(hb.generation == a.generation + 1);
  CHECK_THAT(hb.reason, Catch::Contains("rank 1") && Catch::Contains("missed heartbeats"));
  // The old generation's store and barrier are closed to it.
  auto store = client.store("j", a.generation);
  CHECK_THROWS_AS(store->set("k", "v"), Error);
  try {
    store->set("k", "v");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kAborted);
  }
}

TEST_CASE("a failure report ends the generation; after finish by all nodes the job completes") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {"--heartbeat-timeout", "1"});
  CoordinatorClient client(opts(coord));
  auto j1 = client.join(node("j", "a", 1, 1, 1));
  client.report_failure("j", j1.generation, 0, "exit code 3");
  auto hb = client.heartbeat("j", j1.generation, {0, "h", 1, 0, 0, 0});
  CHECK(hb.abort);
  CHECK_THAT(hb.reason, Catch::Contains("rank 0 failed: exit code 3"));
  // A stale failure report changes nothing.
  client.report_failure("j", j1.generation, 0, "late duplicate");
  auto j2 = client.join(node("j", "a", 1, 1, 1));
  CHECK(j2.generation == 1);
  client.finish("j", j2.generation, 0);
  // Completed: silence no longer ends the generation, and joining again is refused.
  std::this_thread::sleep_for(1500ms);
  CHECK_FALSE(client.node_heartbeat("j", j2.generation, 0).abort);
  try {
    client.join(node("j", "b", 1, 1, 1));
    FAIL("joined a completed job");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("completed"));
  }
}

TEST_CASE("the Heartbeater reports progress and calls on_abort once the generation moves on") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(opts(coord));
  auto j = client.join(node("j", "a", 1, 1, 2));
  std::promise<std::string> aborted;
  std::atomic<int> calls{0};
  {
    Heartbeater hb(client, "j", j.generation, 1, [&](const std::string& reason) {
      if (calls++ == 0) aborted.set_value(reason);
    });
    hb.update(17, 3.25, 999);
    std::this_thread::sleep_for(1500ms);  // at least one heartbeat after update()
    auto rs = test::run_all(
        {{{"/bin/sh", "-c", test::bin("trnctl") + " status j --json --coordinator " + coord.address()}, {}}}, 30s);
    CHECK_THAT(rs[0].output, Catch::Contains("\"rank\": 1") && Catch::Contains("\"step\": 17"));
    client.report_failure("j", j.generation, 0, "rank 0 died");
    auto f = aborted.get_future();
    REQUIRE(f.wait_for(10s) == std::future_status::ready);
    CHECK_THAT(f.get(), Catch::Contains("rank 0 failed: rank 0 died"));
  }
  CHECK(calls == 1);
}
