// The coordinator-backed Store, barriers, job isolation and bad input, against a real
// trn-coordinator on loopback.
#include <catch2/catch.hpp>

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

JoinResult join_single(CoordinatorClient& client, const std::string& job, int nproc) {
  JoinRequest r;
  r.job_id = job;
  r.node_id = "only";
  r.host = "localhost";
  r.nproc_per_node = nproc;
  r.deadline = Deadline::after(10s);
  return client.join(r);
}

}  // namespace

TEST_CASE("store get waits for a set, and times out naming the key") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord, 10s));
  auto j = join_single(client, "job", 2);
  auto s0 = client.store("job", j.generation);
  auto s1 = client.store("job", j.generation);
  auto waiter = std::async(std::launch::async, [&] { return s1->get("addr/0", Deadline::after(10s)); });
  std::this_thread::sleep_for(200ms);
  s0->set("addr/0", std::string("\x00\x01 binary", 9));
  CHECK(waiter.get() == std::string("\x00\x01 binary", 9));
  CHECK(s0->add("count", 5) == 5);
  CHECK(s1->add("count", -2) == 3);
  CHECK(s1->get("count", Deadline::after(1s)) == "3");
  s0->wait({"addr/0", "count"}, Deadline::after(1s));
  try {
    s0->get("addr/7", Deadline::after(300ms));
    FAIL("get of a key nobody set returned");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kTimeout);
    CHECK_THAT(e.what(), Catch::Contains("waited") && Catch::Contains("for key 'addr/7'"));
  }
  try {
    s0->wait({"addr/0", "addr/5", "count"}, Deadline::after(300ms));
    FAIL("wait for a missing key returned");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kTimeout);
    CHECK_THAT(e.what(), Catch::Contains("2 of 3 set") && Catch::Contains("'addr/5'"));
  }
  // add() on a non-integer is refused and changes nothing.
  CHECK_THROWS_AS(s0->add("addr/0", 1), Error);
  CHECK(s0->get("addr/0", Deadline::after(1s)).size() == 9);
}

TEST_CASE("two jobs never see each other's keys") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord, 10s));
  auto ja = join_single(client, "job-a", 1);
  auto jb = join_single(client, "job-b", 1);
  auto a = client.store("job-a", ja.generation);
  auto b = client.store("job-b", jb.generation);
  a->set("k", "from-a");
  b->set("k", "from-b");
  CHECK(a->get("k", Deadline::after(1s)) == "from-a");
  CHECK(b->get("k", Deadline::after(1s)) == "from-b");
  a->set("only-a", "1");
  CHECK_THROWS_AS(b->get("only-a", Deadline::after(200ms)), Error);
  CHECK(a->add("n", 1) == 1);
  CHECK(b->add("n", 10) == 10);
  // A store of a job that never joined is refused, not created.
  auto ghost = client.store("job-ghost", 0);
  try {
    ghost->set("k", "v");
    FAIL("set in an unknown job succeeded");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("job-ghost"));
  }
}

TEST_CASE("barrier releases all ranks together and names missing ranks on timeout") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord, 10s));
  auto j = join_single(client, "job", 3);
  std::vector<std::future<void>> fs;
  for (int r = 0; r < 3; ++r)
    fs.push_back(std::async(std::launch::async, [&, r] {
      if (r == 2) std::this_thread::sleep_for(300ms);
      client.barrier("job", j.generation, "start", r, 3, Deadline::after(10s));
    }));
  for (auto& f : fs) f.get();
  // Rank 1 never comes.
  auto f0 = std::async(std::launch::async,
                       [&] { client.barrier("job", j.generation, "end", 0, 3, Deadline::after(3s)); });
  try {
    client.barrier("job", j.generation, "end", 2, 3, Deadline::after(700ms));
    FAIL("barrier passed with a rank missing");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kTimeout);
    CHECK_THAT(e.what(), Catch::Contains("missing ranks: 1"));
  }
  CHECK_THROWS_AS(f0.get(), Error);
}

TEST_CASE("malformed and out-of-range requests get INVALID_ARGUMENT and change nothing") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  CoordinatorClient client(test::client_options(coord, 10s));
  auto expect_usage = [](auto&& f, const char* text) {
    try {
      f();
      FAIL("accepted a bad request");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::kUsage);
      CHECK_THAT(e.what(), Catch::Contains(text));
    }
  };
  JoinRequest bad;
  bad.job_id = "job";
  bad.node_id = "n";
  bad.min_nodes = 3;
  bad.max_nodes = 2;
  bad.deadline = Deadline::after(5s);
  expect_usage([&] { client.join(bad); }, "max_nodes 2 is out of range");
  bad.max_nodes = 3;
  bad.job_id = "bad job/id";
  expect_usage([&] { client.join(bad); }, "job_id");
  bad.job_id = "job";
  bad.nproc_per_node = 0;
  expect_usage([&] { client.join(bad); }, "nproc_per_node 0");
  // None of that created the job.
  v1::GetStatusRequest sreq;
  sreq.set_job_id("job");
  v1::GetStatusResponse sresp;
  expect_usage([&] {
    client.impl().call(&v1::Coordinator::Stub::GetStatus, sreq, &sresp, Deadline::after(5s), "status");
  }, "no job 'job'");

  auto j = join_single(client, "job", 2);
  auto s = client.store("job", j.generation);
  expect_usage([&] { s->set("", "v"); }, "key is empty");
  expect_usage([&] { s->set("big", std::string((1 << 20) + 1, 'x')); }, "limit");
  expect_usage([&] { client.heartbeat("job", j.generation, {7, "h", 1, 0, 0, 0}); }, "rank 7 is out of range");
  expect_usage([&] { client.barrier("job", j.generation, "b", 3, 2, Deadline::after(1s)); }, "out of range");
  expect_usage([&] { client.report_shard("job", j.generation, {-1, 0, "p", 0, ""}); }, "negative");
  expect_usage([&] { client.heartbeat("job", j.generation + 5, {0, "h", 1, 0, 0, 0}); }, "no generation");
  CHECK_FALSE(client.heartbeat("job", j.generation, {0, "h", 1, 0, 0, 0}).abort);
}
