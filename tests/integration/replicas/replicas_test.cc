// trn-coordinator replicas over a real 3-member etcd cluster on loopback (trn-coordinator
// --store): one leads, the other answers as a standby naming it; kill -9 the leader and the
// standby takes over with every job, generation, key and committed checkpoint, while a client
// given both addresses carries on without re-joining. One etcd member lost changes nothing; two
// lost, and the coordinators refuse calls saying why, so clients fail with that reason instead
// of hanging. Job tokens survive a failover: the new leader derives them again.
#include <fmt/format.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <fstream>
#include <future>
#include <regex>
#include <thread>

#include "collectives/bootstrap/store.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "launcher/server/etcd.h"
#include "tests/integration/coordinator/coordinator_process.h"
#include "tests/integration/coordinator/helpers.h"
#include "tests/integration/etcd/etcd_cluster.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

// Two replicas: a, started first, is the leader once wait_leader(a) returns; b is its standby.
struct Replicas {
  std::vector<std::string> extra;  // more flags for both replicas
  test::EtcdCluster etcd{3};
  test::TempDir da, db;
  std::unique_ptr<test::CoordinatorProcess> a, b;
  int metrics_a = 0, metrics_b = 0;  // with metrics: each replica's /metrics port

  explicit Replicas(std::vector<std::string> extra_flags = {}, bool tls = false, bool metrics = false)
      : extra(std::move(extra_flags)) {
    if (tls) {
      etcd.use_tls();
      extra.insert(extra.end(), {"--etcd-tls-ca", etcd.tls_file("ca.pem"), "--etcd-tls-cert",
                                 etcd.tls_file("client.pem"), "--etcd-tls-key", etcd.tls_file("client.key")});
    }
    if (metrics) {
      metrics_a = test::free_port();
      metrics_b = test::free_port();
    }
    etcd.start();
    a = std::make_unique<test::CoordinatorProcess>(da.path(), args(metrics_a));
    wait_log(*a, "elected leader");
    b = std::make_unique<test::CoordinatorProcess>(db.path(), args(metrics_b));
  }
  std::vector<std::string> args(int metrics_port = 0) const {
    std::vector<std::string> a = {"--store", etcd.endpoints(),      "--leader-ttl",
                                  "2",       "--heartbeat-timeout", "20"};
    a.insert(a.end(), extra.begin(), extra.end());
    if (metrics_port > 0) a.insert(a.end(), {"--metrics-listen", fmt::format("127.0.0.1:{}", metrics_port)});
    return a;
  }
  static void wait_log(test::CoordinatorProcess& c, const std::string& text, std::chrono::seconds within = 20s) {
    auto until = Clock::now() + within;
    while (Clock::now() < until) {
      if (c.log().find(text) != std::string::npos) return;
      std::this_thread::sleep_for(20ms);
    }
    FAIL("no '" << text << "' in the coordinator's log:\n" << c.log());
  }
  std::string both() const { return a->address() + "," + b->address(); }
};

CoordinatorClient client_of(const std::string& address, Duration timeout = 30s,
                            const std::string& token = "") {
  ClientOptions o;
  o.address = address;
  o.rpc_timeout = timeout;
  o.token = token;
  return CoordinatorClient(o);
}

// A running job "ha" of two one-rank nodes, generation 0.
void start_job(CoordinatorClient& c) {
  auto join = [&](const std::string& id) {
    JoinRequest r;
    r.job_id = "ha";
    r.node_id = id;
    r.host = "host-" + id;
    r.min_nodes = r.max_nodes = 2;
    r.deadline = Deadline::after(30s);
    return c.join(r);
  };
  auto x = std::async(std::launch::async, join, "x");
  auto y = std::async(std::launch::async, join, "y");
  REQUIRE(x.get().generation == 0);
  REQUIRE(y.get().world_size == 2);
}

// A replica that refuses a call (a standby, one that cannot reach etcd) answers UNAVAILABLE, and
// the client tries again until the call's deadline, as a standby may lead any moment; its error
// then quotes the last refusal. A test that expects the refusal passes a short `within`.
coordinator::v1::JobStatus status_of(CoordinatorClient& c, Duration within = 30s) {
  coordinator::v1::GetStatusRequest req;
  req.set_job_id("ha");
  req.set_checkpoint_shards(true);
  coordinator::v1::GetStatusResponse resp;
  c.impl().call(&coordinator::v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(within), "status");
  REQUIRE(resp.jobs_size() == 1);
  return resp.jobs(0);
}

}  // namespace

TEST_CASE("a standby names its leader, takes over from a killed one, and keeps jobs, keys and checkpoints") {
  Replicas r;
  // The standby refuses, naming the leader.
  try {
    auto only_b = client_of(r.b->address(), 2s);
    status_of(only_b, 5s);
    FAIL("a standby answered");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("standby coordinator; the leader is " + r.a->address()));
  }

  auto c = client_of(r.both());
  start_job(c);
  auto store = c.store("ha", 0);
  store->set("fabric/0", "address of rank 0");
  store->set("fabric/1", "address of rank 1");
  CHECK(store->add("counter", 5) == 5);
  for (int rank = 0; rank < 2; ++rank) {
    CHECK(c.heartbeat("ha", 0, {rank, "h", 100 + rank, 40, 2.5, 100.0}).abort == false);
    c.report_shard("ha", 0, {30, rank, fmt::format("/ckpt/step30/rank{}", rank), 64, ""});
  }
  REQUIRE(status_of(c).last_committed_step() == 30);
  {
    // The store's keys are saved within 0.2 s of the change: wait until etcd has them.
    control::etcd::EtcdClient etcd(control::etcd::parse_endpoints(r.etcd.endpoints()));
    auto until = Clock::now() + 20s;
    while (Clock::now() < until) {
      auto got = etcd.range_prefix("/trn/coordinator/kv/ha/");
      if (got.ok() && got.value.size() == 3) break;
      std::this_thread::sleep_for(50ms);
    }
    auto got = etcd.range_prefix("/trn/coordinator/kv/ha/");
    REQUIRE(got.ok());
    REQUIRE(got.value.size() == 3);  // fabric/0, fabric/1, counter
    REQUIRE(got.value[0].key.rfind("/trn/coordinator/kv/ha/0/", 0) == 0);  // generation 0's
  }

  r.a->kill9();
  const auto killed = Clock::now();
  // The client's first call finds a gone and the standby not yet leading: it retries until b
  // leads, without re-joining.
  auto beat = c.heartbeat("ha", 0, {0, "h", 100, 41, 2.4, 100.0});
  const double takeover_s = std::chrono::duration<double>(Clock::now() - killed).count();
  CHECK_FALSE(beat.abort);
  CHECK(beat.generation == 0);
  INFO("takeover took " << takeover_s << " s");
  CHECK(takeover_s < 15);  // the lease is 2 s: a bound on a hang, not a speed claim
  Replicas::wait_log(*r.b, "restored 1 jobs");

  auto st = status_of(c);
  CHECK(st.state() == "running");
  CHECK(st.generation() == 0);
  CHECK(st.restarts() == 0);
  CHECK(st.last_committed_step() == 30);
  REQUIRE(st.checkpoints_size() == 1);
  CHECK(st.checkpoints(0).shards_size() == 2);
  CHECK(store->get("fabric/0", Deadline::after(10s)) == "address of rank 0");
  CHECK(store->get("fabric/1", Deadline::after(10s)) == "address of rank 1");
  CHECK(store->add("counter", 1) == 6);
  // Work goes on: the next checkpoint commits on the new leader.
  for (int rank = 0; rank < 2; ++rank) c.report_shard("ha", 0, {60, rank, fmt::format("/ckpt/step60/rank{}", rank), 64, ""});
  CHECK(status_of(c).last_committed_step() == 60);

  // The old leader comes back as a standby of the new one.
  r.a->restart_same_port();
  Replicas::wait_log(*r.a, "listening");
  std::this_thread::sleep_for(500ms);
  try {
    auto only_a = client_of(r.a->address(), 2s);
    status_of(only_a, 5s);
    FAIL("the restarted replica answered as a leader");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("standby coordinator; the leader is " + r.b->address()));
  }
}

TEST_CASE("node heartbeat datagrams follow the leader: after kill -9 of it they go to the standby that took over") {
  Replicas r({}, false, true);
  // Node heartbeats answered OK as datagrams by the replica serving /metrics on port.
  auto datagrams = [](int port) {
    const std::string page = test::http_get(port, "/metrics");
    std::smatch m;
    static const std::regex line(R"re(trn_coordinator_rpcs_total\{method="HeartbeatDatagram",code="OK"\} (\d+))re");
    return std::regex_search(page, m, line) ? std::stoll(m[1].str()) : 0;
  };
  auto c = client_of(r.both());
  start_job(c);
  CHECK_FALSE(c.node_heartbeat("ha", 0, 0, {}, "host-x").abort);
  CHECK(datagrams(r.metrics_a) == 1);

  r.a->kill9();
  // The next heartbeat's datagram goes to the dead leader and gets no answer; its gRPC fallback
  // moves to the standby once it leads, and the answer names its port and epoch.
  CHECK_FALSE(c.node_heartbeat("ha", 0, 0, {}, "host-x").abort);
  Replicas::wait_log(*r.b, "restored 1 jobs");
  for (int i = 0; i < 3; ++i) CHECK_FALSE(c.node_heartbeat("ha", 0, 0, {}, "host-x").abort);
  CHECK(datagrams(r.metrics_b) >= 3);
  CHECK(status_of(c).generation() == 0);
}

TEST_CASE("one etcd member lost changes nothing; two lost, and the coordinators refuse calls saying why") {
  Replicas r;
  auto c = client_of(r.both(), 8s);
  start_job(c);
  // Checkpoints commit back to back through the loss of etcd's leader, so that writes are in
  // flight when it goes: each commit is written to etcd before it is answered.
  std::atomic<bool> done{false};
  auto commits = std::async(std::launch::async, [&] {
    auto w = client_of(r.both(), 8s);
    int64_t step = 0;
    while (!done.load()) {
      ++step;
      w.report_shard("ha", 0, {step, 0, fmt::format("/ckpt/step{}/rank0", step), 1, ""});
      w.report_shard("ha", 0, {step, 1, fmt::format("/ckpt/step{}/rank1", step), 1, ""});
    }
    return step;
  });
  std::this_thread::sleep_for(500ms);
  r.etcd.kill(r.etcd.leader() >= 0 ? r.etcd.leader() : 0);
  // A new etcd leader within about an election timeout; the coordinator keeps leading.
  for (int i = 0; i < 20; ++i) {
    auto beat = c.heartbeat("ha", 0, {0, "h", 100, i, 2.0, 1.0});
    REQUIRE_FALSE(beat.abort);
    std::this_thread::sleep_for(150ms);
  }
  done = true;
  const int64_t last = commits.get();
  CHECK(last > 1);
  CHECK(status_of(c).last_committed_step() == last);
  CHECK_THAT(r.a->log(), !Catch::Contains("stopped accepting writes"));

  for (int i = 0; i < 3; ++i)
    if (r.etcd.running(i)) {
      r.etcd.kill(i);
      break;
    }
  // Without a quorum the leader's lease cannot be kept: it stops accepting writes within its
  // TTL, and every call fails (after the client's 8 s) with the coordinators' reason.
  std::string failure;
  const auto until = Clock::now() + 60s;
  while (failure.empty() && Clock::now() < until) {
    try {
      c.heartbeat("ha", 0, {0, "h", 100, 99, 2.0, 1.0});
      std::this_thread::sleep_for(200ms);
    } catch (const Error& e) {
      failure = e.what();
    }
  }
  INFO(failure);
  CHECK_THAT(failure, Catch::Contains("accept"));  // "does not accept calls" or "stopped accepting writes"
  CHECK_THAT(failure, Catch::Contains("quorum"));
  Replicas::wait_log(*r.a, "stopped accepting writes");
}

TEST_CASE(
    "a job's token after a failover: the standby sends it to the leader; the new leader accepts it and hands "
    "it out") {
  test::TempDir secrets;
  std::ofstream(secrets.path() + "/admin") << "replicas-admin-token\n";
  Replicas r({"--token-file", secrets.path() + "/admin"});
  auto admin = client_of(r.both(), 30s, "replicas-admin-token");
  JoinRequest join;
  join.job_id = "ha";
  join.node_id = "x";
  join.host = "host-x";
  join.deadline = Deadline::after(30s);
  const std::string token = admin.join(join).job_token;
  REQUIRE(token.size() == 64);
  JoinRequest other = join;
  other.job_id = "hb";
  const std::string other_token = admin.join(other).job_token;

  // A standby holds no jobs, so it cannot judge a job's token: it sends the caller to the leader.
  try {
    auto only_b = client_of(r.b->address(), 2s, token);
    only_b.heartbeat("ha", 0, {0, "h", 100, 1, 2.0, 1.0});
    FAIL("a standby answered");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("standby coordinator; the leader is " + r.a->address()));
  }

  auto worker = client_of(r.both(), 30s, token);
  worker.report_shard("ha", 0, {10, 0, "/ckpt/step10/rank0", 1, ""});
  r.a->kill9();
  // The new leader derives the job's token from the admin token and the nonce saved in etcd.
  CHECK_FALSE(worker.heartbeat("ha", 0, {0, "h", 100, 11, 2.0, 1.0}).abort);
  CHECK(worker.report_shard("ha", 0, {20, 0, "/ckpt/step20/rank0", 1, ""}) == 20);
  CHECK(admin.join(join).job_token == token);  // a node joining after the failover gets the same token
  try {
    auto intruder = client_of(r.both(), 10s, other_token);
    intruder.heartbeat("ha", 0, {0, "h", 100, 12, 2.0, 1.0});
    FAIL("job hb's token acted on job ha");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("the token of job 'hb' may act on that job only"));
  }
}

TEST_CASE("over an etcd that requires TLS and client certificates, replicas elect a leader and serve; one without them does not") {
  Replicas r({}, true);
  auto c = client_of(r.both(), 20s);
  start_job(c);
  c.report_shard("ha", 0, {10, 0, "/ckpt/step10/rank0", 1, ""});
  c.report_shard("ha", 0, {10, 1, "/ckpt/step10/rank1", 1, ""});
  CHECK(status_of(c).last_committed_step() == 10);

  // The etcd client itself: plaintext, or TLS without a client certificate, is refused.
  etcd::Options plain;
  plain.timeout = 2s;
  CHECK_FALSE(etcd::EtcdClient(r.etcd.endpoint_list(), plain).put("/probe", "x").ok());
  etcd::Options no_cert = r.etcd.client_options();
  no_cert.timeout = 2s;
  no_cert.tls_cert.clear();
  no_cert.tls_key.clear();
  CHECK_FALSE(etcd::EtcdClient(r.etcd.endpoint_list(), no_cert).put("/probe", "x").ok());
  etcd::Options full = r.etcd.client_options();
  CHECK(etcd::EtcdClient(r.etcd.endpoint_list(), full).put("/probe", "x").ok());

  // A third replica without the TLS flags never reaches etcd: it neither leads nor serves, and
  // tells its callers why; the leader is undisturbed.
  test::TempDir dc;
  test::CoordinatorProcess plain_replica(dc.path(), {"--store", r.etcd.endpoints(), "--leader-ttl", "2"});
  std::this_thread::sleep_for(3s);
  CHECK_THAT(plain_replica.log(), !Catch::Contains("elected leader"));
  auto direct = client_of(plain_replica.address(), 3s);
  std::string refused;
  try {
    status_of(direct, 5s);
  } catch (const Error& e) {
    refused = e.what();
  }
  CHECK_THAT(refused, Catch::Contains("does not accept calls"));
  CHECK_THAT(plain_replica.log(), Catch::Contains("cannot reach etcd"));
  CHECK(status_of(c).last_committed_step() == 10);
}


TEST_CASE("a damaged record in etcd: the replica refuses every call, logs the cause once per record, and counts it") {
  test::EtcdCluster etcd{1};
  etcd.start();
  etcd::EtcdClient store(etcd::parse_endpoints(etcd.endpoints()));
  const std::string first = "/trn/coordinator/jobs/broken";
  REQUIRE(store.put(first, "\xff\xff not a job record").ok());
  test::TempDir dir;
  const int metrics = test::free_port();
  test::CoordinatorProcess c(dir.path(), {"--store", etcd.endpoints(), "--leader-ttl", "2", "--metrics-listen",
                                          fmt::format("127.0.0.1:{}", metrics)});
  const std::string cause = "etcd key " + first + " does not hold a job record";
  auto refusals = [&] {
    const std::string page = test::http_get(metrics, "/metrics");
    std::smatch m;
    static const std::regex line(R"re(\ntrn_coordinator_damaged_state_refusals_total (\d+)\n)re");
    return std::regex_search(page, m, line) ? std::stoll(m[1].str()) : -1;
  };
  auto occurrences = [&](const std::string& text) {
    const std::string log = c.log();
    size_t n = 0;
    for (auto at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
    return n;
  };
  // A client is told the cause.
  try {
    auto client = client_of(c.address(), 2s);
    client.heartbeat("ha", 0, {0, "h", 100, 1, 2.0, 1.0});
    FAIL("a replica on a damaged state answered");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains(cause));
  }
  // The replica tries to lead 4 times a second; the cause is logged once, every refusal counted.
  const auto until = Clock::now() + 20s;
  while (refusals() < 3 && Clock::now() < until) std::this_thread::sleep_for(50ms);
  CHECK(refusals() >= 3);
  CHECK(occurrences("refusing every call: " + cause + ";") == 1);

  // Another damaged record is another cause, logged once in its turn; mended, the replica leads.
  const std::string second = "/trn/coordinator/jobs/broken2";
  const std::string second_cause = "etcd key " + second + " does not hold a job record";
  REQUIRE(store.put(second, "\xff\xff not a job record either").ok());
  REQUIRE(store.delete_key(first).ok());
  Replicas::wait_log(c, "refusing every call: " + second_cause);
  const int64_t before = refusals();
  REQUIRE(store.delete_key(second).ok());
  Replicas::wait_log(c, "elected leader");
  CHECK(occurrences("refusing every call: " + cause + ";") == 1);
  CHECK(occurrences("refusing every call: " + second_cause) == 1);
  CHECK(refusals() >= before);
}
