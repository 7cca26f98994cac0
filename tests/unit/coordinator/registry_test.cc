// The coordinator's state manager with no network: a fake clock drives settle times, wait
// deadlines and heartbeat timeouts.
#include "launcher/server/registry.h"

#include <fmt/format.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <optional>
#include <thread>

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

struct Fixture {
  Clock::time_point now = Clock::time_point() + 1000h;
  int64_t wall_ms = 1'700'000'000'000;  // moves with now
  std::vector<v1::LogRecord> saved;
  Registry reg;

  static RegistryOptions make(Fixture* f, RegistryOptions o) {
    o.heartbeat_timeout = 10s;
    o.now = [f] { return f->now; };
    o.unix_ms = [f] { return f->wall_ms; };
    o.persist = [f](const v1::LogRecord& r) { f->saved.push_back(r); };
    o.limits.max_keys_per_job = 4;
    o.limits.max_value_bytes = 16;
    return o;
  }
  explicit Fixture(RegistryOptions o = {}) : reg(make(this, std::move(o))) {}

  struct JoinOut {
    std::optional<Status> status;
    v1::JoinResponse resp;
  };
  std::shared_ptr<JoinOut> join(const std::string& job, const std::string& id, int min, int max, int nproc = 1,
                                int64_t settle_ms = 1000, int64_t timeout_ms = 60000) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_node_id(id);
    r.set_host(fmt::format("h{}", id));
    r.set_nproc_per_node(nproc);
    r.set_min_nodes(min);
    r.set_max_nodes(max);
    r.set_settle_ms(settle_ms);
    r.set_timeout_ms(timeout_ms);
    auto out = std::make_shared<JoinOut>();
    reg.join(r, [out](const Status& s, v1::JoinResponse resp) {
      out->status = s;
      out->resp = std::move(resp);
    });
    return out;
  }
  void advance(Duration d) {
    now += d;
    wall_ms += std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
    reg.tick();
  }
  void finish(const std::string& job, int64_t gen = 0) {
    v1::FinishRequest r;
    r.set_job_id(job);
    r.set_generation(gen);
    r.set_node_rank(0);
    v1::FinishResponse resp;
    REQUIRE(reg.finish(r, &resp).ok());
  }
  bool has(const std::string& job) {
    v1::GetStatusResponse resp;
    return reg.status(job, &resp).ok();
  }
  v1::HeartbeatResponse heartbeat(const std::string& job, int64_t gen, int rank, bool node = false) {
    v1::HeartbeatRequest r;
    r.set_job_id(job);
    r.set_generation(gen);
    r.set_rank(rank);
    r.set_kind(node ? v1::HeartbeatRequest::NODE : v1::HeartbeatRequest::WORKER);
    r.set_step(42);
    v1::HeartbeatResponse resp;
    REQUIRE(reg.heartbeat(r, &resp).ok());
    return resp;
  }
  v1::JobStatus status(const std::string& job) {
    v1::GetStatusResponse resp;
    REQUIRE(reg.status(job, &resp).ok());
    return resp.jobs(0);
  }
};

}  // namespace

TEST_CASE("a round waits for the settle time after min_nodes, then ranks nodes by id") {
  Fixture f;
  auto z = f.join("j", "z", 2, 4, 3);
  auto a = f.join("j", "a", 2, 4, 2);
  CHECK_FALSE(z->status);
  f.advance(500ms);
  CHECK_FALSE(a->status);  // settling: a third node may still come
  auto m = f.join("j", "m", 2, 4, 1);
  f.advance(900ms);
  CHECK_FALSE(m->status);  // the settle clock restarted with m
  f.advance(200ms);
  REQUIRE(a->status);
  CHECK(a->status->ok());
  CHECK(a->resp.node_rank() == 0);
  CHECK(m->resp.node_rank() == 1);
  CHECK(m->resp.rank_offset() == 2);
  CHECK(z->resp.node_rank() == 2);
  CHECK(z->resp.rank_offset() == 3);
  CHECK(z->resp.world_size() == 6);
  CHECK(f.saved.size() == 1);  // the started generation was persisted
}

TEST_CASE("a round completes at once when max_nodes join; a spare waits for the next round") {
  Fixture f;
  auto a = f.join("j", "a", 1, 2);
  auto b = f.join("j", "b", 1, 2);
  REQUIRE(b->status);
  CHECK(b->resp.nnodes() == 2);
  auto c = f.join("j", "c", 1, 2);  // full: a spare
  f.advance(5s);
  CHECK_FALSE(c->status);
  CHECK(f.status("j").pending_joiners() == 1);
  // A failure ends generation 0; the spare and a re-joining node form generation 1.
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_generation(0);
  fr.set_rank(1);
  fr.set_reason("boom");
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  CHECK(frr.generation() == 1);
  auto a2 = f.join("j", "a", 1, 2);
  REQUIRE(c->status);
  CHECK(c->resp.generation() == 1);
  CHECK(a2->resp.node_rank() == 0);
  CHECK(c->resp.node_rank() == 1);
}

TEST_CASE("a node of the last generation keeps its node rank; a replacement takes the free one") {
  Fixture f;
  auto a = f.join("j", "a", 2, 2, 2);
  auto b = f.join("j", "b", 2, 2, 2);
  REQUIRE(b->status);
  CHECK(a->resp.node_rank() == 0);
  CHECK(b->resp.node_rank() == 1);
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_generation(0);
  fr.set_rank(2);
  fr.set_reason("host b lost");
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  // "a" returns, "0" replaces "b": by node id "0" would come first, but a keeps rank 0 and its
  // workers their ranks 0 and 1.
  auto a2 = f.join("j", "a", 2, 2, 2);
  auto r = f.join("j", "0", 2, 2, 2);
  REQUIRE(r->status);
  REQUIRE(a2->status);
  CHECK(a2->resp.generation() == 1);
  CHECK(a2->resp.node_rank() == 0);
  CHECK(a2->resp.rank_offset() == 0);
  CHECK(r->resp.node_rank() == 1);
  CHECK(r->resp.rank_offset() == 2);
}

TEST_CASE("mismatched node counts in one round are refused") {
  Fixture f;
  auto a = f.join("j", "a", 2, 2);
  auto b = f.join("j", "b", 3, 3);
  REQUIRE(b->status);
  CHECK(b->status->code == Code::kInvalidArgument);
  CHECK_THAT(b->status->message, Catch::Contains("same node counts"));
  CHECK_FALSE(a->status);
}

TEST_CASE("a join that waits too long fails and leaves the round") {
  Fixture f;
  auto a = f.join("j", "a", 2, 2, 1, 0, 3000);
  f.advance(2s);
  CHECK_FALSE(a->status);
  f.advance(2s);
  REQUIRE(a->status);
  CHECK(a->status->code == Code::kDeadlineExceeded);
  CHECK_THAT(a->status->message, Catch::Contains("1 of min 2 nodes"));
  CHECK(f.status("j").pending_joiners() == 0);
}

TEST_CASE("missed heartbeats end the generation; finished nodes are exempt; a completed job stays") {
  Fixture f;
  f.join("j", "a", 2, 2);
  f.join("j", "b", 2, 2);
  f.heartbeat("j", 0, 0);
  f.heartbeat("j", 0, 1);
  f.advance(6s);
  f.heartbeat("j", 0, 0);
  f.advance(6s);  // rank 1 silent for 12 s
  auto hb = f.heartbeat("j", 0, 0);
  CHECK(hb.abort());
  CHECK(hb.generation() == 1);
  CHECK_THAT(hb.reason(), Catch::Contains("rank 1") && Catch::Contains("missed heartbeats"));
  auto st = f.status("j");
  CHECK(st.restarts() == 1);
  CHECK(st.state() == "forming");

  auto a = f.join("j", "a", 2, 2);
  auto b = f.join("j", "b", 2, 2);
  REQUIRE(b->status);
  for (int node : {0, 1}) {
    v1::FinishRequest fin;
    fin.set_job_id("j");
    fin.set_generation(1);
    fin.set_node_rank(node);
    v1::FinishResponse fr;
    REQUIRE(f.reg.finish(fin, &fr).ok());
    CHECK(fr.job_completed() == (node == 1));
  }
  f.advance(60s);
  CHECK(f.status("j").state() == "completed");
  CHECK(f.status("j").generation() == 1);
}

TEST_CASE("a checkpoint step commits when every rank's shard is reported") {
  Fixture f;
  f.join("j", "a", 1, 1, 3);
  auto report = [&](int64_t step, int rank) {
    v1::ReportShardRequest r;
    r.set_job_id("j");
    r.set_generation(0);
    r.set_step(step);
    r.mutable_shard()->set_rank(rank);
    r.mutable_shard()->set_path(fmt::format("p{}", rank));
    v1::ReportShardResponse resp;
    REQUIRE(f.reg.report_shard(r, &resp).ok());
    return resp.last_committed_step();
  };
  CHECK(report(100, 0) == -1);
  CHECK(report(100, 2) == -1);
  CHECK(report(100, 2) == -1);  // a repeated shard counts once
  size_t saves = f.saved.size();
  CHECK(report(100, 1) == 100);
  CHECK(f.saved.size() == saves + 1);
  CHECK(report(200, 0) == 100);
  const auto& rec = f.saved.back();  // the changed job's whole state, nothing else
  REQUIRE(rec.has_job());
  CHECK(rec.job().job_id() == "j");
  CHECK(rec.job().checkpoints(0).step() == 100);
}

TEST_CASE("store limits and waits, and a new generation starts with an empty store") {
  Fixture f;
  f.join("j", "a", 1, 1);
  auto set = [&](const std::string& k, const std::string& v, int64_t gen = 0) {
    v1::SetRequest r;
    r.set_job_id("j");
    r.set_generation(gen);
    r.set_key(k);
    r.set_value(v);
    return f.reg.set(r);
  };
  std::optional<Status> got;
  std::string value;
  v1::GetRequest g;
  g.set_job_id("j");
  g.set_key("k0");
  g.set_timeout_ms(5000);
  f.reg.get(g, [&](const Status& s, std::string v) {
    got = s;
    value = v;
  });
  CHECK_FALSE(got);
  CHECK(set("k0", "v0").ok());
  REQUIRE(got);
  CHECK(value == "v0");
  CHECK(set("k1", std::string(17, 'x')).code == Code::kInvalidArgument);
  CHECK(set("k1", "1").ok());
  CHECK(set("k2", "2").ok());
  CHECK(set("k3", "3").ok());
  CHECK(set("k4", "4").code == Code::kResourceExhausted);
  CHECK(set("k3", "33").ok());  // overwriting is not a new key
  CHECK(set("k0", "x", 1).code == Code::kInvalidArgument);  // no generation 1 yet

  got.reset();
  g.set_key("never");
  f.reg.get(g, [&](const Status& s, std::string) { got = s; });
  f.advance(6s);
  REQUIRE(got);
  CHECK(got->code == Code::kDeadlineExceeded);
  CHECK_THAT(got->message, Catch::Contains("for key 'never'"));

  // A wait of the old generation is aborted when the generation ends.
  got.reset();
  f.reg.get(g, [&](const Status& s, std::string) { got = s; });
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_reason("x");
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  REQUIRE(got);
  CHECK(got->code == Code::kAborted);
  f.join("j", "a", 1, 1);
  g.set_generation(1);
  g.set_key("k0");
  g.set_timeout_ms(0);
  got.reset();
  f.reg.get(g, [&](const Status& s, std::string) { got = s; });
  f.advance(1ms);
  REQUIRE(got);
  CHECK(got->code == Code::kDeadlineExceeded);
}

TEST_CASE("a snapshot restores jobs, generations, restarts, checkpoints and keys") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  v1::SetRequest s;
  s.set_job_id("j");
  s.set_key("addr");
  s.set_value("xyz");
  REQUIRE(f.reg.set(s).ok());
  v1::Snapshot snap = f.reg.snapshot();

  Fixture g;
  g.reg.restore(snap);
  auto st = g.status("j");
  CHECK(st.state() == "running");
  CHECK(st.world_size() == 2);
  CHECK(st.nodes_size() == 1);
  std::optional<Status> got;
  std::string value;
  v1::GetRequest req;
  req.set_job_id("j");
  req.set_key("addr");
  g.reg.get(req, [&](const Status& st2, std::string v) {
    got = st2;
    value = v;
  });
  REQUIRE(got);
  CHECK(value == "xyz");
  CHECK_FALSE(g.heartbeat("j", 0, 1).abort());
}

TEST_CASE("add() refuses a sum that overflows 64 bits and keeps the value") {
  Fixture f;
  f.join("j", "a", 1, 1, 1);
  v1::AddRequest r;
  r.set_job_id("j");
  r.set_generation(0);
  r.set_key("n");
  r.set_delta(INT64_MAX - 1);
  int64_t v = 0;
  REQUIRE(f.reg.add(r, &v).ok());
  CHECK(v == INT64_MAX - 1);
  r.set_delta(2);
  const Status s = f.reg.add(r, &v);
  CHECK(s.code == Code::kInvalidArgument);
  CHECK_THAT(s.message, Catch::Contains("would overflow") && Catch::Contains(std::to_string(INT64_MAX - 1)));
  r.set_delta(1);
  REQUIRE(f.reg.add(r, &v).ok());
  CHECK(v == INT64_MAX);
  r.set_delta(INT64_MIN);
  REQUIRE(f.reg.add(r, &v).ok());
  CHECK(v == -1);
}

TEST_CASE("a snapshot that names a job twice is refused whole, and the jobs already there stay") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  v1::Snapshot snap = f.reg.snapshot();
  REQUIRE(snap.jobs_size() == 1);
  *snap.add_jobs() = snap.jobs(0);
  snap.mutable_jobs(1)->set_state("failed");
  Fixture g;
  g.join("k", "b", 1, 1, 1);
  CHECK_THROWS_WITH(g.reg.restore(snap), Catch::Contains("names job 'j' twice"));
  CHECK(g.status("k").state() == "running");
  g.reg.tick();  // expiry visits what restore kept: nothing of the refused state
}

TEST_CASE("events reach subscribers in order, with replay of recent ones") {
  Fixture f;
  f.join("j", "a", 1, 1);
  std::vector<v1::Event> seen;
  f.reg.subscribe("j", true, [&](const v1::Event& e) {
    seen.push_back(e);
    return true;
  });
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].kind() == v1::Event::JOINED);
  CHECK(seen[1].kind() == v1::Event::GENERATION_STARTED);
  f.join("other", "x", 1, 1);
  CHECK(seen.size() == 2);  // another job's events are not ours
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_reason("oom");
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  REQUIRE(seen.size() == 4);
  CHECK(seen[2].kind() == v1::Event::FAILURE);
  CHECK(seen[3].kind() == v1::Event::GENERATION_ENDED);
  CHECK(seen[3].seq() > seen[2].seq());
}

TEST_CASE("finished jobs are removed after the retention, oldest first beyond the count cap") {
  RegistryOptions o;
  o.job_retention = 60s;
  o.max_finished_jobs = 2;
  Fixture f(o);
  for (const char* j : {"a", "b", "c"}) {
    f.join(j, "n", 1, 1);
    f.finish(j);
    f.advance(2s);
  }
  CHECK_FALSE(f.has("a"));  // three finished, two kept: the oldest went
  CHECK(f.has("b"));
  CHECK(f.has("c"));
  REQUIRE_FALSE(f.saved.empty());
  bool removed_a = false;
  for (const auto& r : f.saved) removed_a |= r.removed_job() == "a";
  CHECK(removed_a);  // the removal reaches --state-dir too
  f.join("running", "n", 1, 1);
  f.advance(61s);
  CHECK_FALSE(f.has("b"));
  CHECK_FALSE(f.has("c"));
  CHECK(f.has("running"));  // a running job never expires
}

TEST_CASE("a new job finding the job cap full takes the place of the oldest finished one") {
  RegistryOptions o;
  o.limits.max_jobs = 3;
  Fixture f(o);
  for (const char* j : {"a", "b", "c"}) {
    f.join(j, "n", 1, 1);
    f.finish(j);
    f.advance(10ms);
  }
  auto d = f.join("d", "n", 1, 1);
  REQUIRE(d->status);
  CHECK(d->status->ok());
  CHECK_FALSE(f.has("a"));
  CHECK(f.has("b"));
  // With only running jobs held, the cap holds.
  RegistryOptions o2;
  o2.limits.max_jobs = 1;
  Fixture g(o2);
  g.join("x", "n", 1, 1);
  auto y = g.join("y", "n", 1, 1);
  REQUIRE(y->status);
  CHECK(y->status->code == Code::kResourceExhausted);
}

TEST_CASE("a failure reported with give_up fails the job: it is finished and cannot be joined again") {
  Fixture f;
  f.join("j", "a", 1, 1);
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_reason("exit code 2");
  fr.set_give_up(true);
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  CHECK(f.status("j").state() == "failed");
  CHECK(f.status("j").ended_unix_ms() == f.wall_ms);
  auto again = f.join("j", "a", 1, 1);
  REQUIRE(again->status);
  CHECK(again->status->code == Code::kFailedPrecondition);
  CHECK_THAT(again->status->message, Catch::Contains("exit code 2"));
}

TEST_CASE("restored members have an unknown heartbeat age until they heartbeat again") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  f.heartbeat("j", 0, 0);
  f.heartbeat("j", 0, 1);
  v1::Snapshot snap = f.reg.snapshot();
  Fixture g;
  g.reg.restore(snap);
  auto st = g.status("j");
  REQUIRE(st.nodes_size() == 1);
  CHECK(st.nodes(0).heartbeat_unknown());
  CHECK(st.nodes(0).heartbeat_age_ms() == -1);
  REQUIRE(st.workers_size() == 2);
  CHECK(st.workers(0).heartbeat_unknown());
  CHECK(st.workers(1).heartbeat_unknown());
  g.advance(1s);
  g.heartbeat("j", 0, 1);
  st = g.status("j");
  CHECK_FALSE(st.nodes(0).heartbeat_unknown());
  CHECK(st.workers(0).heartbeat_unknown());
  CHECK_FALSE(st.workers(1).heartbeat_unknown());
  CHECK(st.workers(1).heartbeat_age_ms() == 0);
}

TEST_CASE("a worker's heartbeat carries its grid coordinates into its status") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  v1::HeartbeatRequest r;
  r.set_job_id("j");
  r.set_rank(1);
  r.mutable_coordinates()->set_dp_rank(1);
  r.mutable_coordinates()->set_tp_rank(0);
  r.mutable_coordinates()->set_pp_rank(0);
  v1::HeartbeatResponse resp;
  REQUIRE(f.reg.heartbeat(r, &resp).ok());
  f.heartbeat("j", 0, 0);  // no coordinates
  auto st = f.status("j");
  REQUIRE(st.workers(1).has_coordinates());
  CHECK(st.workers(1).coordinates().dp_rank() == 1);
  CHECK_FALSE(st.workers(0).has_coordinates());
  r.mutable_coordinates()->set_tp_rank(-1);
  CHECK(f.reg.heartbeat(r, &resp).code == Code::kInvalidArgument);
}

namespace {

// Node `node`'s heartbeat forwarding `ranks` (rank, step, age in ms, beats).
struct Entry {
  int rank;
  int64_t step;
  int64_t age_ms;
  int beats = 1;
  bool silent = false;  // RankHeartbeat.silent: the process alive age_ms ago, not a heartbeat
};
Status node_beat(Fixture& f, int node, const std::vector<Entry>& ranks, v1::HeartbeatResponse* resp = nullptr,
                 uint64_t datagram_seq = 0, int64_t generation = 0) {
  v1::HeartbeatRequest r;
  r.set_job_id("j");
  r.set_generation(generation);
  r.set_kind(v1::HeartbeatRequest::NODE);
  r.set_rank(node);
  r.set_host(fmt::format("host{}", node));
  for (const auto& e : ranks) {
    auto* x = r.add_ranks();
    x->set_rank(e.rank);
    x->set_pid(1000 + e.rank);
    x->set_step(e.step);
    x->set_loss(0.5);
    x->set_age_ms(e.age_ms);
    x->set_beats(e.beats);
    x->set_silent(e.silent);
    x->mutable_coordinates()->set_dp_rank(e.rank);
  }
  v1::HeartbeatResponse local;
  return f.reg.heartbeat(r, resp ? resp : &local, datagram_seq);
}

}  // namespace

TEST_CASE("a node heartbeat datagram counts once: an older or repeated sequence number changes nothing") {
  Fixture f;
  f.join("j", "a", 2, 2, 2);
  f.join("j", "b", 2, 2, 2);
  REQUIRE(node_beat(f, 1, {{2, 7, 0, 1}}, nullptr, 100).ok());
  f.advance(5s);
  // A replay of that datagram (the same sequence), or an older one, would make the node look alive.
  for (uint64_t seq : {100u, 99u}) {
    Status s = node_beat(f, 1, {{2, 8, 0, 1}}, nullptr, seq);
    CHECK(s.code == Code::kFailedPrecondition);
    CHECK(s.message.find("not newer") != std::string::npos);
  }
  auto st = f.status("j");
  CHECK(st.workers(2).step() == 7);
  CHECK(st.workers(2).heartbeat_age_ms() == 5000);
  // Each node counts its own sequence; gRPC calls (sequence 0) are never checked.
  REQUIRE(node_beat(f, 0, {{0, 3, 0, 1}}, nullptr, 50).ok());
  REQUIRE(node_beat(f, 1, {{2, 9, 0, 1}}).ok());
  REQUIRE(node_beat(f, 1, {{2, 10, 0, 1}}, nullptr, 101).ok());
  CHECK(f.status("j").workers(2).step() == 10);
  // A gRPC heartbeat sent in place of datagram 150, which got no answer: that datagram arriving
  // late (or any older one) no longer counts.
  {
    v1::HeartbeatRequest r;
    r.set_job_id("j");
    r.set_kind(v1::HeartbeatRequest::NODE);
    r.set_rank(1);
    r.set_datagram_seq(150);
    auto* x = r.add_ranks();
    x->set_rank(2);
    x->set_step(11);
    v1::HeartbeatResponse resp;
    REQUIRE(f.reg.heartbeat(r, &resp).ok());
  }
  CHECK(node_beat(f, 1, {{2, 10, 0, 1}}, nullptr, 150).code == Code::kFailedPrecondition);
  CHECK(f.status("j").workers(2).step() == 11);
  CHECK(node_beat(f, 1, {{2, 12, 0, 1}}, nullptr, 151).ok());
  // A worker heartbeat never comes as a datagram.
  v1::HeartbeatRequest w;
  w.set_job_id("j");
  w.set_rank(2);
  v1::HeartbeatResponse resp;
  CHECK(f.reg.heartbeat(w, &resp, 102).code == Code::kInvalidArgument);
}

TEST_CASE("a new generation starts every node's datagram sequence afresh") {
  Fixture f;
  f.join("j", "a", 2, 2, 1);
  f.join("j", "b", 2, 2, 1);
  REQUIRE(node_beat(f, 1, {{1, 7, 0, 1}}, nullptr, 1000).ok());
  v1::ReportFailureRequest fail;
  fail.set_job_id("j");
  fail.set_rank(0);
  fail.set_reason("rank 0 died");
  v1::ReportFailureResponse fresp;
  REQUIRE(f.reg.report_failure(fail, &fresp).ok());
  f.join("j", "a", 2, 2, 1);
  f.join("j", "b", 2, 2, 1);
  REQUIRE(f.status("j").generation() == 1);
  // The agent of node 1 started anew: its sequence numbers are lower than before.
  CHECK(node_beat(f, 1, {{1, 1, 0, 1}}, nullptr, 10, 1).ok());
}

TEST_CASE("a node heartbeat's entries count as its ranks' own heartbeats, aged as the agent heard them") {
  Fixture f;
  f.join("j", "a", 2, 2, 2);
  f.join("j", "b", 2, 2, 2);  // node 1: ranks 2 and 3
  REQUIRE(node_beat(f, 1, {{2, 7, 0, 1}, {3, 9, 4000, 3}}).ok());
  auto st = f.status("j");
  REQUIRE(st.workers_size() == 4);
  CHECK(st.workers(2).step() == 7);
  CHECK(st.workers(2).heartbeat_age_ms() == 0);
  CHECK(st.workers(3).step() == 9);
  CHECK(st.workers(3).heartbeat_age_ms() == 4000);
  CHECK(st.workers(3).heartbeats() == 3);
  CHECK(st.workers(3).host() == "host1");
  CHECK(st.workers(3).pid() == 1003);
  CHECK(st.workers(3).coordinates().dp_rank() == 3);
  CHECK(st.workers(0).heartbeat_age_ms() == -1);  // node 0's ranks: not heard from yet
  // An older forwarded heartbeat never makes a rank look older than it is.
  REQUIRE(node_beat(f, 1, {{2, 8, 500}}).ok());
  CHECK(f.status("j").workers(2).heartbeat_age_ms() == 0);
  CHECK(f.status("j").workers(2).step() == 8);
}

TEST_CASE("a rank its node stops forwarding ends the generation though the node heartbeats on") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  REQUIRE(node_beat(f, 0, {{0, 1, 0}, {1, 1, 0}}).ok());
  v1::HeartbeatResponse resp;
  for (int i = 0; i < 9; ++i) {  // rank 1 hangs: the agent forwards only rank 0 for 9 s
    f.advance(1s);
    REQUIRE(node_beat(f, 0, {{0, 2 + i, 100}}, &resp).ok());
    CHECK_FALSE(resp.abort());
  }
  CHECK(f.status("j").workers(1).heartbeat_age_ms() == 9000);
  CHECK(f.status("j").nodes(0).heartbeat_age_ms() == 0);
  f.advance(1100ms);
  REQUIRE(node_beat(f, 0, {{0, 20, 0}}, &resp).ok());
  CHECK(resp.abort());
  CHECK_THAT(resp.reason(), Catch::Contains("rank 1 (host0 pid 1001) missed heartbeats"));
}

TEST_CASE("a worker its node reports silent since it started ends the generation after the timeout") {
  // Stopped before its first heartbeat, a worker would be judged only by its node, which goes on
  // heartbeating: its agent's silent entry starts the rank's timeout at the process's start.
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  v1::HeartbeatResponse resp;
  REQUIRE(node_beat(f, 0, {{0, 1, 0}, {1, 0, 2000, 0, true}}, &resp).ok());
  auto st = f.status("j");
  CHECK(st.workers(1).heartbeats() == 0);         // no heartbeat: still starting to status
  CHECK(st.workers(1).heartbeat_age_ms() == -1);
  CHECK(st.workers(1).pid() == 1001);
  for (int i = 1; i <= 7; ++i) {
    f.advance(1s);
    REQUIRE(node_beat(f, 0, {{0, 1 + i, 0}, {1, 0, 2000 + 1000 * i, 0, true}}, &resp).ok());
    CHECK_FALSE(resp.abort());
  }
  f.advance(1100ms);  // 10.1 s since the process started: past the 10 s timeout
  REQUIRE(node_beat(f, 0, {{0, 20, 0}}, &resp).ok());
  CHECK(resp.abort());
  CHECK_THAT(resp.reason(), Catch::Contains("rank 1 (host0 pid 1001) missed heartbeats for 10.1 s"));
}

TEST_CASE("a silent entry for a rank heard in the generation changes nothing") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  REQUIRE(node_beat(f, 0, {{0, 1, 0}, {1, 3, 0}}).ok());
  f.advance(5s);
  REQUIRE(node_beat(f, 0, {{0, 2, 0}, {1, 0, 1000, 0, true}}).ok());
  auto st = f.status("j");
  CHECK(st.workers(1).heartbeat_age_ms() == 5000);
  CHECK(st.workers(1).heartbeats() == 1);
  CHECK(st.workers(1).step() == 3);
}

TEST_CASE(
    "a node heartbeat with a rank of another node, a repeated rank or a bad age is refused and changes "
    "nothing") {
  Fixture f;
  f.join("j", "a", 2, 2, 2);
  f.join("j", "b", 2, 2, 2);
  auto refused = [&](const std::vector<Entry>& e, const std::string& needle) {
    auto s = node_beat(f, 0, e);
    INFO(s.message);
    CHECK(s.code == Code::kInvalidArgument);
    CHECK_THAT(s.message, Catch::Contains(needle));
  };
  refused({{0, 5, 0}, {2, 5, 0}}, "not one of its ranks 0..1");
  refused({{1, 5, 0}, {1, 6, 0}}, "twice");
  refused({{0, 5, -1}}, "age_ms -1");
  refused({{0, 5, 0, -2}}, "beats -2");
  auto st = f.status("j");
  for (const auto& w : st.workers()) CHECK(w.heartbeats() == 0);
  CHECK(st.workers(0).heartbeat_age_ms() == -1);
  // A worker's own heartbeat carries no ranks of others.
  v1::HeartbeatRequest r;
  r.set_job_id("j");
  r.set_rank(0);
  r.add_ranks()->set_rank(1);
  v1::HeartbeatResponse resp;
  CHECK(f.reg.heartbeat(r, &resp).code == Code::kInvalidArgument);
}

// (An elastic job keeps such a node as a spare: "a round completes at once when max_nodes join".)
TEST_CASE("a new node joining a running fixed-size job is refused at once") {
  Fixture f;
  f.join("fixed", "a", 2, 2);
  f.join("fixed", "b", 2, 2);
  REQUIRE(f.status("fixed").state() == "running");
  auto c = f.join("fixed", "c", 2, 2);
  REQUIRE(c->status);
  CHECK(c->status->code == Code::kFailedPrecondition);
  CHECK_THAT(c->status->message, Catch::Contains("already running (generation 0, all 2 of its 2 nodes)"));
  CHECK(f.status("fixed").pending_joiners() == 0);
  auto a = f.join("fixed", "a", 2, 2);  // a member's repeated join still gets its answer
  REQUIRE(a->status);
  CHECK(a->status->ok());
  // A member gone silent (a third of the heartbeat timeout): a new node may be its replacement
  // and waits for the round the timeout starts.
  f.heartbeat("fixed", 0, 0, true);
  f.advance(4s);
  auto d = f.join("fixed", "d", 2, 2);
  CHECK_FALSE(d->status);
  CHECK(f.status("fixed").pending_joiners() == 1);
  f.join("one", "a", 1, 1);
  auto second = f.join("one", "b", 1, 1);
  REQUIRE(second->status);
  CHECK(second->status->code == Code::kFailedPrecondition);
}

TEST_CASE(
    "a user stop makes the job stopped: no restart, members told to stop and refused, a new node starts a "
    "new run") {
  Fixture f;
  auto a = f.join("j", "a", 1, 1);
  REQUIRE(a->status);
  const std::string run = a->resp.run_id();
  CHECK(run.size() == 16);
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_rank(0);
  fr.set_reason("node 0 interrupted by SIGINT");
  fr.set_user_stop(true);
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  auto st = f.status("j");
  CHECK(st.state() == "stopped");
  CHECK(st.restarts() == 0);
  CHECK(st.generation() == 0);
  CHECK(st.reason() == "node 0 interrupted by SIGINT");
  auto hb = f.heartbeat("j", 0, 0, true);
  CHECK(hb.abort());
  CHECK(hb.stopped());
  // A failure report racing the stop changes nothing.
  fr.set_user_stop(false);
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  CHECK(f.status("j").state() == "stopped");
  CHECK(f.status("j").restarts() == 0);
  auto again = f.join("j", "a", 1, 1);
  REQUIRE(again->status);
  CHECK(again->status->code == Code::kFailedPrecondition);
  auto fresh = f.join("j", "b", 1, 1);
  REQUIRE(fresh->status);
  CHECK(fresh->status->ok());
  CHECK(fresh->resp.generation() == 1);
  CHECK(fresh->resp.run_id() != run);
  CHECK(f.status("j").restarts() == 0);
}

namespace {

v1::RecoveryStatus recovery(int64_t count, double to_first_step = 0.45, int64_t replaced = 1) {
  v1::RecoveryStatus r;
  r.set_recoveries(count);
  r.set_detect_to_generation_s(0.12);
  r.set_detect_to_restored_s(0.30);
  r.set_detect_to_first_step_s(to_first_step);
  r.set_restored_step(100 * count);
  r.set_steps_lost(0);
  r.set_steps_lost_total(3);
  r.set_replaced(replaced);
  r.set_goodput(0.965);
  return r;
}

// Rank `rank`'s own heartbeat (kind WORKER) carrying a recovery report.
Status recovery_beat(Fixture& f, int64_t gen, int rank, const v1::RecoveryStatus& r,
                     v1::HeartbeatResponse* resp = nullptr) {
  v1::HeartbeatRequest req;
  req.set_job_id("j");
  req.set_generation(gen);
  req.set_rank(rank);
  *req.mutable_recovery() = r;
  v1::HeartbeatResponse local;
  return f.reg.heartbeat(req, resp ? resp : &local);
}

// The RECOVERED events of job j from now on.
std::shared_ptr<std::vector<v1::Event>> recovered_events(Fixture& f) {
  auto seen = std::make_shared<std::vector<v1::Event>>();
  f.reg.subscribe("j", false, [seen](const v1::Event& e) {
    if (e.kind() == v1::Event::RECOVERED) seen->push_back(e);
    return true;
  });
  return seen;
}

// The recovery count of the newest saved record of job j, or -1 when it has none.
int64_t saved_recoveries(const Fixture& f) {
  for (auto it = f.saved.rbegin(); it != f.saved.rend(); ++it)
    if (it->has_job() && it->job().job_id() == "j")
      return it->job().has_recovery() ? it->job().recovery().recoveries() : -1;
  return -1;
}

}  // namespace

TEST_CASE("rank 0's recovery report is the job's: kept across generations, one RECOVERED event per new count") {
  Fixture f;
  f.join("j", "a", 1, 1, 2);
  auto events = recovered_events(f);
  CHECK_FALSE(f.status("j").has_recovery());

  // Another rank's report is not the job's.
  REQUIRE(recovery_beat(f, 0, 1, recovery(5)).ok());
  CHECK_FALSE(f.status("j").has_recovery());
  CHECK(events->empty());

  REQUIRE(recovery_beat(f, 0, 0, recovery(1)).ok());
  auto st = f.status("j");
  REQUIRE(st.has_recovery());
  CHECK(st.recovery().recoveries() == 1);
  CHECK(st.recovery().detect_to_first_step_s() == 0.45);
  CHECK(st.recovery().goodput() == 0.965);
  REQUIRE(events->size() == 1);
  CHECK((*events)[0].detail() == "recovery 1 in generation 0: 0.45 s to the next step, 0 steps lost, 1 process replaced");
  CHECK((*events)[0].step() == 100);
  CHECK((*events)[0].generation() == 0);
  CHECK(saved_recoveries(f) == 1);  // a new count is saved with the job

  // The same count again (every heartbeat carries it) is no new recovery, but its figures are kept.
  const size_t saves = f.saved.size();
  auto later = recovery(1);
  later.set_goodput(0.97);
  REQUIRE(recovery_beat(f, 0, 0, later).ok());
  CHECK(events->size() == 1);
  CHECK(f.saved.size() == saves);
  CHECK(f.status("j").recovery().goodput() == 0.97);

  // The generation ends and the node re-joins (in place): the report stays with the job.
  v1::ReportFailureRequest fr;
  fr.set_job_id("j");
  fr.set_rank(1);
  fr.set_reason("worker exited with signal 9");
  v1::ReportFailureResponse frr;
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  CHECK(f.status("j").recovery().recoveries() == 1);
  f.join("j", "a", 1, 1, 2);
  st = f.status("j");
  REQUIRE(st.generation() == 1);
  REQUIRE(st.state() == "running");
  CHECK(st.recovery().recoveries() == 1);

  // Rank 0 of the ended generation is told to abort; its report changes nothing.
  v1::HeartbeatResponse old;
  REQUIRE(recovery_beat(f, 0, 0, recovery(9), &old).ok());
  CHECK(old.abort());
  CHECK(f.status("j").recovery().recoveries() == 1);

  // Rank 0 of the new generation, forwarded by its node's agent: recovery 2.
  v1::HeartbeatRequest node;
  node.set_job_id("j");
  node.set_generation(1);
  node.set_kind(v1::HeartbeatRequest::NODE);
  node.set_rank(0);
  auto* e = node.add_ranks();
  e->set_rank(0);
  *e->mutable_recovery() = recovery(2, 0.5, 2);
  v1::HeartbeatResponse resp;
  REQUIRE(f.reg.heartbeat(node, &resp).ok());
  REQUIRE(events->size() == 2);
  CHECK((*events)[1].detail() == "recovery 2 in generation 1: 0.50 s to the next step, 0 steps lost, 2 processes replaced");
  CHECK((*events)[1].step() == 200);
  CHECK(saved_recoveries(f) == 2);

  auto g = f.reg.gauges();
  REQUIRE(g.per_job.size() == 1);
  REQUIRE(g.per_job[0].recovery);
  CHECK(g.per_job[0].recovery->recoveries() == 2);
  CHECK(g.per_job[0].recovery->replaced() == 2);

  // A restarted coordinator (--state-dir) still has it, and does not announce it again.
  Fixture h;
  h.reg.restore(f.reg.snapshot());
  auto again = recovered_events(h);
  CHECK(h.status("j").recovery().recoveries() == 2);
  REQUIRE(recovery_beat(h, 1, 0, recovery(2)).ok());
  CHECK(again->empty());

  // A new run (a new trnrun after this one stopped) starts without the old run's recoveries.
  fr.set_generation(1);
  fr.set_user_stop(true);
  REQUIRE(f.reg.report_failure(fr, &frr).ok());
  f.join("j", "b", 1, 1, 2);
  st = f.status("j");
  REQUIRE(st.state() == "running");
  CHECK_FALSE(st.has_recovery());
  CHECK_FALSE(f.reg.gauges().per_job[0].recovery);
}

TEST_CASE("a recovery report with a lower count is kept, and its next recovery is announced") {
  Fixture f;
  f.join("j", "a", 1, 1, 1);
  auto events = recovered_events(f);
  REQUIRE(recovery_beat(f, 0, 0, recovery(3)).ok());
  // Rank 0 started anew (its process was replaced) and counts from 0: no recovery yet.
  REQUIRE(recovery_beat(f, 0, 0, recovery(0)).ok());
  CHECK(f.status("j").recovery().recoveries() == 0);
  REQUIRE(recovery_beat(f, 0, 0, recovery(1)).ok());
  REQUIRE(events->size() == 2);
  CHECK_THAT((*events)[0].detail(), Catch::StartsWith("recovery 3 in generation 0"));
  CHECK_THAT((*events)[1].detail(), Catch::StartsWith("recovery 1 in generation 0"));
}

TEST_CASE("an impossible recovery report is ignored, and the heartbeat carrying it still counts") {
  Fixture f;
  f.join("j", "a", 1, 1, 1);
  auto events = recovered_events(f);
  REQUIRE(recovery_beat(f, 0, 0, recovery(1)).ok());
  auto bad = [&](auto spoil) {
    auto r = recovery(7);
    spoil(r);
    const int64_t beats = f.status("j").workers(0).heartbeats();
    REQUIRE(recovery_beat(f, 0, 0, r).ok());
    CHECK(f.status("j").workers(0).heartbeats() == beats + 1);
    CHECK(f.status("j").recovery().recoveries() == 1);
  };
  bad([](v1::RecoveryStatus& r) { r.set_recoveries(-1); });
  bad([](v1::RecoveryStatus& r) { r.set_detect_to_first_step_s(std::nan("")); });
  bad([](v1::RecoveryStatus& r) { r.set_detect_to_restored_s(-0.5); });
  bad([](v1::RecoveryStatus& r) { r.set_steps_lost_total(-3); });
  bad([](v1::RecoveryStatus& r) { r.set_goodput(1.5); });
  CHECK(events->size() == 1);
}

namespace {

// A running job of `nodes` nodes of `nproc` ranks each, generation 0.
void start_job(Fixture& f, const std::string& job, int nodes, int nproc) {
  for (int i = 0; i < nodes; ++i) f.join(job, fmt::format("n{:03}", i), nodes, nodes, nproc);
  REQUIRE(f.status(job).state() == "running");
}

// Node `node`'s heartbeat forwarding the given ranks, each heard age_ms ago.
Status node_beat(Fixture& f, const std::string& job, int node,
                 const std::vector<std::pair<int, int64_t>>& ranks, int64_t step = 7, double loss = 2.0) {
  v1::HeartbeatRequest r;
  r.set_job_id(job);
  r.set_kind(v1::HeartbeatRequest::NODE);
  r.set_rank(node);
  r.set_host(fmt::format("host{}", node));
  for (auto [rank, age] : ranks) {
    auto* e = r.add_ranks();
    e->set_rank(rank);
    e->set_pid(1000 + rank);
    e->set_step(step + rank);
    e->set_loss(loss);
    e->set_tokens_per_s(10);
    e->set_age_ms(age);
  }
  v1::HeartbeatResponse resp;
  return f.reg.heartbeat(r, &resp);
}

v1::GetStatusResponse status_of(Fixture& f, v1::GetStatusRequest req) {
  v1::GetStatusResponse resp;
  REQUIRE(f.reg.status(req, &resp).ok());
  return resp;
}

}  // namespace

TEST_CASE("status summarises a job by health: counts, progress, and the longest silent first") {
  Fixture f;                  // heartbeat timeout 10 s
  start_job(f, "big", 4, 4);  // ranks 0..15; node i holds 4i..4i+3
  f.advance(6s);              // every node silent 6 s so far
  REQUIRE(node_beat(f, "big", 0, {{0, 0}, {1, 0}, {2, 3000}, {3, 0}}).ok());  // rank 2 heard 3 s before
  REQUIRE(node_beat(f, "big", 1, {{4, 0}, {5, 0}, {6, 0}, {7, 0}}).ok());
  REQUIRE(node_beat(f, "big", 2, {{8, 0}}).ok());  // 9..11 never heard
  f.advance(1s);  // now node 3 is 7 s silent (stuck: >= 5 s), rank 2 4 s (late: >= 3 s)

  v1::GetStatusRequest req;
  req.set_job_id("big");
  req.set_max_ranks(-1);
  req.set_late_ms(3000);
  req.set_stuck_ms(5000);
  req.set_max_attention(3);
  auto resp = status_of(f, req);
  REQUIRE(resp.jobs_size() == 1);
  const auto& j = resp.jobs(0);
  CHECK(j.workers_size() == 0);  // the summary alone
  CHECK(j.nodes_size() == 0);
  CHECK(j.nnodes() == 4);
  CHECK(j.next_rank() == 0);
  CHECK(j.node_health().healthy() == 3);
  CHECK(j.node_health().stuck() == 1);
  CHECK(j.rank_health().healthy() == 8);   // 0, 1, 3, 4..8
  CHECK(j.rank_health().late() == 1);      // 2
  CHECK(j.rank_health().starting() == 7);  // 9..15: never heard, judged with their node
  CHECK(j.rank_health().stuck() + j.rank_health().dead() + j.rank_health().unknown() == 0);
  REQUIRE(j.attention_nodes_size() == 1);
  CHECK(j.attention_nodes(0).member().node_rank() == 3);
  CHECK(j.attention_nodes(0).heartbeat_age_ms() == 7000);
  REQUIRE(j.attention_ranks_size() == 1);
  CHECK(j.attention_ranks(0).rank() == 2);
  CHECK(j.attention_ranks(0).heartbeat_age_ms() == 4000);
  CHECK(j.attention_ranks(0).host() == "host0");
  CHECK(j.attention_ranks(0).pid() == 1002);
  CHECK(j.progress().reporting() == 9);
  CHECK(j.progress().min_step() == 7);
  CHECK(j.progress().max_step() == 15);
  CHECK(j.progress().mean_loss() == Approx(2.0));
  CHECK(j.progress().tokens_per_s() == Approx(90));
}

TEST_CASE("status pages the rank list; one reply for every job spends one budget of ranks") {
  Fixture f;
  start_job(f, "a", 3, 4);  // ranks 0..11
  v1::GetStatusRequest req;
  req.set_job_id("a");
  req.set_rank_start(3);
  req.set_max_ranks(5);
  auto j = status_of(f, req).jobs(0);
  REQUIRE(j.workers_size() == 5);
  CHECK(j.workers(0).rank() == 3);
  CHECK(j.workers(4).rank() == 7);
  CHECK(j.workers(0).host() == "hn000");  // not heard from: its node's host
  CHECK(j.workers(0).heartbeat_age_ms() == -1);
  REQUIRE(j.nodes_size() == 2);  // the nodes holding ranks 3..7
  CHECK(j.nodes(0).member().node_rank() == 0);
  CHECK(j.nodes(1).member().node_rank() == 1);
  CHECK(j.next_rank() == 8);
  CHECK(j.rank_health().starting() == 12);  // the summary counts every rank, not the page's

  req.set_rank_start(8);
  req.set_max_ranks(100);
  j = status_of(f, req).jobs(0);
  CHECK(j.workers_size() == 4);
  CHECK(j.next_rank() == 12);  // == world size: the list is complete

  req.set_rank_start(50);  // past the end: nothing
  j = status_of(f, req).jobs(0);
  CHECK(j.workers_size() == 0);
  CHECK(j.next_rank() == 12);

  // The default page lists a small job whole, as before pages existed.
  j = f.status("a");
  CHECK(j.workers_size() == 12);
  CHECK(j.nodes_size() == 3);
  CHECK(j.next_rank() == 12);

  v1::GetStatusResponse resp;
  req.set_max_ranks(16385);
  CHECK(f.reg.status(req, &resp).code == Code::kInvalidArgument);
  req.set_max_ranks(10);
  req.set_rank_start(-1);
  CHECK(f.reg.status(req, &resp).code == Code::kInvalidArgument);

  // Every job: 3 jobs of 6,000 ranks overrun the 16,384-rank budget; the last is cut short and
  // says where its list stopped, with its summary whole.
  Fixture g;
  for (const char* id : {"x", "y", "z"}) start_job(g, id, 2, 3000);
  v1::GetStatusRequest all;
  all.set_max_ranks(16384);
  auto every = status_of(g, all);
  REQUIRE(every.jobs_size() == 3);
  CHECK(every.jobs(0).workers_size() == 6000);
  CHECK(every.jobs(1).workers_size() == 6000);
  CHECK(every.jobs(2).workers_size() == 4384);
  CHECK(every.jobs(2).next_rank() == 4384);
  CHECK(every.jobs(2).rank_health().starting() == 6000);
}

TEST_CASE("node heartbeats from many threads at once, with status and ticks between, lose nothing") {
  Fixture f;
  constexpr int kNodes = 64, kProcs = 8, kRounds = 50, kThreads = 4;
  start_job(f, "par", kNodes, kProcs);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round)
        for (int node = t; node < kNodes; node += kThreads) {
          std::vector<std::pair<int, int64_t>> ranks;
          for (int i = 0; i < kProcs; ++i) ranks.emplace_back(node * kProcs + i, 0);
          if (!node_beat(f, "par", node, ranks, round).ok()) failures++;
        }
    });
  for (int i = 0; i < 20; ++i) {  // readers and the ticker take the lock exclusively meanwhile
    f.reg.tick();
    v1::GetStatusResponse resp;
    f.reg.status("par", &resp);
  }
  for (auto& t : threads) t.join();
  CHECK(failures == 0);
  v1::GetStatusRequest req;
  req.set_job_id("par");
  req.set_max_ranks(-1);
  auto j = status_of(f, req).jobs(0);
  CHECK(j.progress().reporting() == kNodes * kProcs);
  CHECK(j.progress().min_step() == kRounds - 1);  // every rank's last heartbeat is its last round's
  CHECK(j.rank_health().healthy() == kNodes * kProcs);
  auto full = f.status("par");
  for (const auto& w : full.workers()) CHECK(w.heartbeats() == kRounds);
  CHECK(f.reg.gauges().heartbeats == kNodes * kRounds);
}

TEST_CASE(
    "job tokens: one per job for all its nodes and generations, whose job_of_token knows, derived anew after "
    "a restore") {
  RegistryOptions o;
  o.job_token_key = "admin";
  Fixture f(o);
  auto a = f.join("j", "a", 2, 2);
  auto b = f.join("j", "b", 2, 2);
  auto other = f.join("k", "a", 1, 1);
  f.advance(10ms);
  REQUIRE(a->status);
  const std::string token = a->resp.job_token();
  CHECK(token.size() == 64);
  CHECK(b->resp.job_token() == token);
  CHECK(other->resp.job_token() != token);
  CHECK(f.reg.job_of_token(token) == std::optional<std::string>("j"));
  CHECK(f.reg.job_of_token(other->resp.job_token()) == std::optional<std::string>("k"));
  CHECK_FALSE(f.reg.job_of_token("admin"));
  CHECK_FALSE(f.reg.job_of_token(token.substr(1)));
  CHECK_FALSE(f.reg.job_of_token(""));

  // A new generation keeps the job's token.
  v1::ReportFailureRequest fail;
  fail.set_job_id("j");
  fail.set_reason("boom");
  v1::ReportFailureResponse fr;
  REQUIRE(f.reg.report_failure(fail, &fr).ok());
  auto a1 = f.join("j", "a", 2, 2);
  auto b1 = f.join("j", "b", 2, 2);
  f.advance(10ms);
  REQUIRE(a1->status);
  CHECK(a1->resp.generation() == 1);
  CHECK(a1->resp.job_token() == token);

  // The saved state holds the nonce, not the token; restored with the same key, the same token.
  v1::Snapshot snap = f.reg.snapshot();
  CHECK(snap.DebugString().find(token) == std::string::npos);
  Fixture g(o);
  g.reg.restore(snap);
  CHECK(g.reg.job_of_token(token) == std::optional<std::string>("j"));
  auto again = g.join("j", "a", 2, 2);  // a member's repeated join
  REQUIRE(again->status);
  CHECK(again->resp.job_token() == token);
  // Another admin token derives other tokens: the old ones are no job's.
  RegistryOptions rotated;
  rotated.job_token_key = "another admin";
  Fixture h(rotated);
  h.reg.restore(snap);
  CHECK_FALSE(h.reg.job_of_token(token));
}

TEST_CASE("job tokens: a removed job's token is no one's, and a new job of the same id gets another") {
  RegistryOptions o;
  o.job_token_key = "admin";
  o.job_retention = 1s;
  Fixture f(o);
  auto a = f.join("j", "a", 1, 1);
  f.advance(10ms);
  const std::string token = a->resp.job_token();
  f.finish("j");
  f.advance(3s);
  REQUIRE_FALSE(f.has("j"));
  CHECK_FALSE(f.reg.job_of_token(token));
  auto again = f.join("j", "a", 1, 1);
  f.advance(10ms);
  REQUIRE(again->status);
  CHECK(again->resp.job_token().size() == 64);
  CHECK(again->resp.job_token() != token);
}

TEST_CASE("job tokens: none without an admin token") {
  Fixture f;
  auto a = f.join("j", "a", 1, 1);
  f.advance(10ms);
  REQUIRE(a->status);
  CHECK(a->resp.job_token().empty());
  CHECK(f.reg.snapshot().jobs(0).token_nonce().empty());
}
