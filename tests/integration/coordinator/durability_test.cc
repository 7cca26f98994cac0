// The coordinator survives kill -9 (with --state-dir), refuses strangers, and shrugs off garbage.
#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <fstream>
#include <future>
#include <random>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/coordinator_process.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

ClientOptions opts(const test::CoordinatorProcess& c, const std::string& token = "") {
  ClientOptions o;
  o.address = c.address();
  o.token = token;
  o.rpc_timeout = 20s;
  return o;
}

JoinRequest node(const std::string& id, int nodes) {
  JoinRequest r;
  r.job_id = "durable";
  r.node_id = id;
  r.host = fmt::format("h-{}", id);
  r.nproc_per_node = 1;
  r.min_nodes = r.max_nodes = nodes;
  r.deadline = Deadline::after(20s);
  return r;
}

v1::GetStatusResponse status(CoordinatorClient& c, const std::string& job) {
  v1::GetStatusRequest req;
  req.set_job_id(job);
  req.set_checkpoint_shards(true);
  v1::GetStatusResponse resp;
  c.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(20s), "status");
  return resp;
}

}  // namespace

TEST_CASE("after kill -9 and a restart on the same state dir, jobs, generation and checkpoints remain") {
  test::TempDir dir;
  std::string state = dir.path() + "/state";
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", state});
  CoordinatorClient client(opts(coord));
  auto fa = std::async(std::launch::async, [&] { return client.join(node("a", 2)); });
  auto fb = std::async(std::launch::async, [&] { return client.join(node("b", 2)); });
  auto a = fa.get();
  fb.get();
  client.report_failure("durable", a.generation, 1, "simulated crash");  // -> generation 1
  auto ga = std::async(std::launch::async, [&] { return client.join(node("a", 2)); });
  auto gb = std::async(std::launch::async, [&] { return client.join(node("b", 2)); });
  auto g = ga.get();
  gb.get();
  REQUIRE(g.generation == 1);
  CHECK(client.report_shard("durable", 1, {10, 0, "/ckpt/10/0", 100, "aa"}) == -1);
  CHECK(client.report_shard("durable", 1, {10, 1, "/ckpt/10/1", 100, "bb"}) == 10);
  CHECK(client.report_shard("durable", 1, {20, 0, "/ckpt/20/0", 100, ""}) == 10);  // step 20 incomplete
  auto store = client.store("durable", 1);
  store->set("addr/0", "fabric-address-0");
  std::this_thread::sleep_for(500ms);  // key-value changes are saved within ~0.2 s

  coord.kill9();
  // A call made while the coordinator is down waits for it (retry with backoff) and succeeds.
  auto pending = std::async(std::launch::async, [&] { return client.node_heartbeat("durable", 1, 0); });
  std::this_thread::sleep_for(700ms);
  coord.restart_same_port();
  auto hb = pending.get();
  CHECK_FALSE(hb.abort);
  CHECK(hb.generation == 1);

  auto st = status(client, "durable");
  REQUIRE(st.jobs_size() == 1);
  const auto& job = st.jobs(0);
  CHECK(job.generation() == 1);
  CHECK(job.state() == "running");
  CHECK(job.restarts() == 1);
  REQUIRE(job.restart_history_size() == 1);
  CHECK_THAT(job.restart_history(0).cause(), Catch::Contains("simulated crash"));
  CHECK(job.last_committed_step() == 10);
  REQUIRE(job.checkpoints_size() == 1);
  CHECK(job.checkpoints(0).shards_size() == 2);
  CHECK(job.checkpoints(0).shards(1).path() == "/ckpt/10/1");
  CHECK(job.nodes_size() == 2);
  CHECK(store->get("addr/0", Deadline::after(2s)) == "fabric-address-0");
  // The registry goes on from where it was: the other shard of step 20 was lost with the
  // uncommitted state, so step 20 needs both again.
  CHECK(client.report_shard("durable", 1, {20, 1, "/ckpt/20/1", 100, ""}) == 10);
  CHECK(client.report_shard("durable", 1, {20, 0, "/ckpt/20/0", 100, ""}) == 20);

  auto r = coord.terminate();
  CHECK(r.exit_code == 0);
  INFO(coord.log());
  CHECK_THAT(coord.log(), Catch::Contains("restored 1 jobs"));
}

TEST_CASE("a wrong or missing token is refused with UNAUTHENTICATED") {
  test::TempDir dir;
  std::string tf = dir.path() + "/token";
  std::ofstream(tf) << "s3cret-token\n";
  test::CoordinatorProcess coord(dir.path(), {"--token-file", tf});
  JoinRequest r = node("a", 1);
  for (std::string bad : {"", "wrong", "s3cret-token-x", "s3cret-toke"}) {
    CoordinatorClient client(opts(coord, bad));
    try {
      client.join(r);
      FAIL("joined with token '" << bad << "'");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::kUsage);
      CHECK_THAT(e.what(), Catch::Contains("token"));
    }
  }
  CoordinatorClient good(opts(coord, "s3cret-token"));
  CHECK(good.join(r).world_size == 1);
  // The refusals changed nothing: the job has only the good node.
  CHECK(status(good, "durable").jobs(0).nodes_size() == 1);
}

TEST_CASE("garbage bytes on the port do not crash the coordinator") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  std::mt19937 rng(42);
  for (int round = 0; round < 20; ++round) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(coord.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    std::string junk;
    if (round == 0) junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    else if (round == 1) junk = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + std::string(100, '\xff');
    else
      for (int i = 0; i < 64 * round; ++i) junk.push_back(static_cast<char>(rng()));
    (void)::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    ::close(fd);
  }
  REQUIRE(coord.running());
  CoordinatorClient client(opts(coord));
  CHECK(client.join(node("a", 1)).world_size == 1);
}

TEST_CASE("once a shard report found the coordinator gone, later reports make one short try, and recover") {
  test::TempDir tmp;
  const std::string& dir = tmp.path();
  test::CoordinatorProcess coord(dir, {"--state-dir", dir + "/state"});
  ClientOptions o = opts(coord);
  o.rpc_timeout = 4s;
  CoordinatorClient c(o);
  auto j = c.join(node("a", 1));
  CHECK(c.report_shard("durable", j.generation, {5, 0, "/ck/step-5", 1, ""}) == 5);
  coord.kill9();
  std::string first, second;
  try {
    c.report_shard("durable", j.generation, {10, 0, "/ck/step-10", 1, ""});
  } catch (const Error& e) {
    first = e.what();
  }
  try {
    c.report_shard("durable", j.generation, {15, 0, "/ck/step-15", 1, ""});
  } catch (const Error& e) {
    second = e.what();
  }
  INFO(first << "\n" << second);
  CHECK_THAT(first, Catch::Contains("unreachable"));
  CHECK_THAT(first, !Catch::Contains("one short try"));
  CHECK_THAT(second, Catch::Contains("one short try"));
  coord.restart_same_port();
  // Back: the next report gets through (a short try suffices for a live coordinator), and the
  // one after it has the whole timeout again.
  int64_t committed = -1;
  for (int i = 0; i < 20 && committed < 0; ++i) {
    try {
      committed = c.report_shard("durable", j.generation, {20, 0, "/ck/step-20", 1, ""});
    } catch (const Error&) {
    }
  }
  CHECK(committed == 20);
}
