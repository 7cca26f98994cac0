// Who may call what on a coordinator with tokens (--token-file, --read-token-file): every
// refusal over real gRPC, with its code and its one line; a job's token on its own job, on
// another job and on calls of every job; the read-only token; job tokens across a restart from
// --state-dir; and no token in a log, a status reply, /metrics or the saved state.
#include <fmt/format.h>
#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <regex>
#include <sstream>

#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "tests/integration/coordinator/helpers.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

const std::string kAdmin = "admin-token-0123456789";
const std::string kReader = "read-only-token-9876543210";

// A coordinator requiring tokens: admin and read-only token files in its folder, and its state
// in DIR/state.
struct Secured {
  test::TempDir dir;
  int metrics_port = test::free_port();
  std::unique_ptr<test::CoordinatorProcess> coord;

  Secured() {
    std::ofstream(dir.path() + "/admin") << kAdmin << "\n";
    std::ofstream(dir.path() + "/reader") << kReader << "\n";
    coord = std::make_unique<test::CoordinatorProcess>(
        dir.path(), std::vector<std::string>{"--token-file", dir.path() + "/admin", "--read-token-file",
                                             dir.path() + "/reader", "--state-dir", dir.path() + "/state",
                                             "--metrics-listen", fmt::format("127.0.0.1:{}", metrics_port)});
  }
  CoordinatorClient client(const std::string& token) const {
    return CoordinatorClient(test::client_options(*coord, 20s, token));
  }
};

// One call as it goes on the wire, with `token` (none when empty), and its status.
class Raw {
 public:
  explicit Raw(const std::string& address)
      : stub_(v1::Coordinator::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {}

  template <typename Req, typename Resp>
  grpc::Status call(const std::string& token,
                    grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
                    const Req& req, Resp* resp = nullptr) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    Resp ignored;
    return (stub_.get()->*method)(&ctx, req, resp ? resp : &ignored);
  }

  // WatchEvents of job (empty: every job) with replay: the first event, or the refusal.
  grpc::Status watch(const std::string& token, const std::string& job, v1::Event* first = nullptr) {
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    ctx.set_deadline(std::chrono::system_clock::now() + 10s);
    v1::WatchEventsRequest req;
    req.set_job_id(job);
    req.set_replay(true);
    auto reader = stub_->WatchEvents(&ctx, req);
    v1::Event ev;
    if (reader->Read(&ev)) {
      if (first) *first = ev;
      ctx.TryCancel();
      reader->Finish();
      return grpc::Status::OK;
    }
    return reader->Finish();
  }

 private:
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// Every call of the API on `job` (generation 0, rank 0), by name, each returning its status.
std::vector<std::pair<std::string, std::function<grpc::Status(const std::string&)>>> calls_on(
    Raw& raw, const std::string& job) {
  using S = v1::Coordinator::Stub;
  std::vector<std::pair<std::string, std::function<grpc::Status(const std::string&)>>> calls;
  calls.emplace_back("Join", [&raw, job](const std::string& t) {
    v1::JoinRequest r;
    r.set_job_id(job);
    r.set_node_id("intruder");
    r.set_host("h");
    r.set_nproc_per_node(1);
    r.set_min_nodes(1);
    r.set_max_nodes(1);
    r.set_timeout_ms(200);
    return raw.call(t, &S::Join, r);
  });
  calls.emplace_back("Set", [&raw, job](const std::string& t) {
    v1::SetRequest r;
    r.set_job_id(job);
    r.set_key("planted");
    r.set_value("x");
    return raw.call(t, &S::Set, r);
  });
  calls.emplace_back("Get", [&raw, job](const std::string& t) {
    v1::GetRequest r;
    r.set_job_id(job);
    r.set_key("secret");
    r.set_timeout_ms(200);
    return raw.call(t, &S::Get, r);
  });
  calls.emplace_back("Add", [&raw, job](const std::string& t) {
    v1::AddRequest r;
    r.set_job_id(job);
    r.set_key("counter");
    r.set_delta(1);
    return raw.call(t, &S::Add, r);
  });
  calls.emplace_back("Delete", [&raw, job](const std::string& t) {
    v1::DeleteRequest r;
    r.set_job_id(job);
    r.set_key("secret");
    return raw.call(t, &S::Delete, r);
  });
  calls.emplace_back("Barrier", [&raw, job](const std::string& t) {
    v1::BarrierRequest r;
    r.set_job_id(job);
    r.set_name("b");
    r.set_world_size(1);
    r.set_timeout_ms(200);
    return raw.call(t, &S::Barrier, r);
  });
  calls.emplace_back("Heartbeat", [&raw, job](const std::string& t) {
    v1::HeartbeatRequest r;
    r.set_job_id(job);
    r.set_host("h");
    r.set_pid(1);
    r.set_step(999);
    return raw.call(t, &S::Heartbeat, r);
  });
  calls.emplace_back("ReportShard", [&raw, job](const std::string& t) {
    v1::ReportShardRequest r;
    r.set_job_id(job);
    r.set_step(7);
    r.mutable_shard()->set_path("/forged");
    return raw.call(t, &S::ReportShard, r);
  });
  calls.emplace_back("ReportFailure", [&raw, job](const std::string& t) {
    v1::ReportFailureRequest r;
    r.set_job_id(job);
    r.set_reason("forged");
    r.set_give_up(true);
    return raw.call(t, &S::ReportFailure, r);
  });
  calls.emplace_back("Finish", [&raw, job](const std::string& t) {
    v1::FinishRequest r;
    r.set_job_id(job);
    return raw.call(t, &S::Finish, r);
  });
  calls.emplace_back("GetStatus", [&raw, job](const std::string& t) {
    v1::GetStatusRequest r;
    r.set_job_id(job);
    return raw.call(t, &S::GetStatus, r);
  });
  calls.emplace_back("WatchEvents", [&raw, job](const std::string& t) { return raw.watch(t, job); });
  return calls;
}

void check_refused(const grpc::Status& s, grpc::StatusCode code, const std::string& needle) {
  INFO(s.error_code() << ": " << s.error_message());
  CHECK(s.error_code() == code);
  CHECK_THAT(s.error_message(), Catch::Contains(needle));
  CHECK(s.error_message().find('\n') == std::string::npos);
}

v1::JobStatus job_status(CoordinatorClient& admin, const std::string& job) {
  v1::GetStatusRequest req;
  req.set_job_id(job);
  req.set_checkpoint_shards(true);
  v1::GetStatusResponse resp;
  admin.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(20s), "status");
  REQUIRE(resp.jobs_size() == 1);
  return resp.jobs(0);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE(
    "tokens: a job's token is minted at its creation, 64 hex digits, the same for every node and each "
    "re-join") {
  Secured s;
  auto admin = s.client(kAdmin);
  auto join = [&](const std::string& node) {
    JoinRequest r = test::single_node("pair");
    r.node_id = node;
    r.min_nodes = r.max_nodes = 2;
    return admin.join(r);
  };
  auto x = std::async(std::launch::async, join, "x");
  auto y = std::async(std::launch::async, join, "y");
  const std::string token = x.get().job_token;
  CHECK(std::regex_match(token, std::regex("[0-9a-f]{64}")));
  CHECK(y.get().job_token == token);
  CHECK(join("x").job_token == token);  // a member's repeated join
  const std::string other = admin.join(test::single_node("solo")).job_token;
  CHECK(std::regex_match(other, std::regex("[0-9a-f]{64}")));
  CHECK(other != token);

  // A coordinator without --token-file authenticates nobody and hands out no token.
  test::TempDir open_dir;
  test::CoordinatorProcess open(open_dir.path(), {});
  CoordinatorClient anyone(test::client_options(open));
  CHECK(anyone.join(test::single_node("open")).job_token.empty());
}

TEST_CASE("tokens: no token and a wrong token get UNAUTHENTICATED, one line, for every call") {
  Secured s;
  auto admin = s.client(kAdmin);
  admin.join(test::single_node("a"));
  Raw raw(s.coord->address());
  for (auto& [name, call] : calls_on(raw, "a")) {
    INFO(name);
    check_refused(call(""), grpc::StatusCode::UNAUTHENTICATED, "no bearer token");
    check_refused(call("not-a-token"), grpc::StatusCode::UNAUTHENTICATED, "wrong bearer token");
    check_refused(call(kAdmin + "x"), grpc::StatusCode::UNAUTHENTICATED, "wrong bearer token");
  }
  // The client library turns them into usage errors naming the token.
  auto stranger = s.client("guess");
  try {
    stranger.heartbeat("a", 0, {0, "h", 1, 1, 1.0, 1.0});
    FAIL("a wrong token was served");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("wrong bearer token"));
  }
  auto st = job_status(admin, "a");
  CHECK(st.state() == "running");
  CHECK(st.generation() == 0);
  CHECK(st.progress().reporting() == 0);  // no refused heartbeat counted
}

TEST_CASE("tokens: job A's token works on job A and is refused on job B, for every call, changing nothing") {
  Secured s;
  auto admin = s.client(kAdmin);
  const std::string a = admin.join(test::single_node("a")).job_token;
  const std::string b = admin.join(test::single_node("b")).job_token;
  REQUIRE_FALSE(a.empty());
  admin.store("b", 0)->set("secret", "b's fabric address");

  Raw raw(s.coord->address());
  for (auto& [name, call] : calls_on(raw, "b")) {
    INFO(name);
    check_refused(
        call(a), grpc::StatusCode::PERMISSION_DENIED,
        fmt::format("the token of job 'a' may act on that job only (its store, barriers, heartbeats, "
                    "failure and checkpoint reports, status and events), not {} of job 'b'",
                    name));
  }
  // Job b is as it was: nobody joined, no key planted or deleted, no heartbeat, checkpoint or failure.
  auto st = job_status(admin, "b");
  CHECK(st.state() == "running");
  CHECK(st.generation() == 0);
  CHECK(st.nnodes() == 1);
  CHECK(st.restarts() == 0);
  CHECK(st.progress().reporting() == 0);
  CHECK(st.checkpoints_size() == 0);
  auto b_store = admin.store("b", 0);
  CHECK(b_store->get("secret", Deadline::after(5s)) == "b's fabric address");
  CHECK_THROWS_AS(b_store->get("planted", Deadline::after(300ms)), Error);

  // On its own job the token does what a worker does: store, heartbeat, checkpoint, status, events.
  auto worker = s.client(a);
  auto store = worker.store("a", 0);
  store->set("fabric/0", "addr");
  CHECK(store->get("fabric/0", Deadline::after(5s)) == "addr");
  CHECK(store->add("n", 2) == 2);
  CHECK_FALSE(worker.heartbeat("a", 0, {0, "h", 42, 5, 1.5, 10.0}).abort);
  CHECK(worker.report_shard("a", 0, {5, 0, "/ckpt/5", 10, ""}) == 5);
  worker.barrier("a", 0, "ready", 0, 1, Deadline::after(5s));
  CHECK(job_status(worker, "a").last_committed_step() == 5);
  v1::Event first;
  REQUIRE(raw.watch(a, "a", &first).ok());
  CHECK(first.job_id() == "a");
  CHECK(job_status(admin, "a").progress().max_step() == 5);
}

TEST_CASE("tokens: a job's token on a call of every job, or creating a job, gets PERMISSION_DENIED") {
  Secured s;
  auto admin = s.client(kAdmin);
  const std::string a = admin.join(test::single_node("a")).job_token;
  Raw raw(s.coord->address());
  v1::GetStatusRequest all;
  check_refused(raw.call(a, &v1::Coordinator::Stub::GetStatus, all), grpc::StatusCode::PERMISSION_DENIED,
                "the token of job 'a' may act on that job only; GetStatus of every job needs the admin or a "
                "read-only token");
  check_refused(raw.watch(a, ""), grpc::StatusCode::PERMISSION_DENIED,
                "WatchEvents of every job needs the admin or a read-only token");
  for (auto& [name, call] : calls_on(raw, "new-job"))
    if (name == "Join")
      check_refused(call(a), grpc::StatusCode::PERMISSION_DENIED, "not Join of job 'new-job'");
  v1::GetStatusResponse resp;
  REQUIRE(raw.call(kAdmin, &v1::Coordinator::Stub::GetStatus, all, &resp).ok());
  CHECK(resp.jobs_size() == 1);  // no job "new-job"

  // trnctl given the job's token: its own job's checkpoints; every job's status is one line, exit 2.
  std::ofstream(s.dir.path() + "/job-token") << a << "\n";
  auto trnctl = [&](const std::string& args) {
    return test::run_all({{{"/bin/sh", "-c",
                            test::bin("trnctl") + " --coordinator " + s.coord->address() + " --token-file " +
                                s.dir.path() + "/job-token " + args},
                           {}}},
                         30s)[0];
  };
  auto own = trnctl("checkpoints a");
  INFO(own.describe());
  CHECK(own.exit_code == 0);
  auto every = trnctl("status");
  INFO(every.describe());
  CHECK(every.exit_code == 2);
  CHECK_THAT(every.output,
             Catch::StartsWith("trnctl: error: status: the token of job 'a' may act on that job only"));
  CHECK(std::count(every.output.begin(), every.output.end(), '\n') == 1);
}

TEST_CASE(
    "tokens: the read-only token reads status and events of every job; every write gets PERMISSION_DENIED") {
  Secured s;
  auto admin = s.client(kAdmin);
  admin.join(test::single_node("a"));
  Raw raw(s.coord->address());
  for (auto& [name, call] : calls_on(raw, "a")) {
    INFO(name);
    if (name == "GetStatus" || name == "WatchEvents") {
      CHECK(call(kReader).ok());
    } else {
      check_refused(
          call(kReader), grpc::StatusCode::PERMISSION_DENIED,
          fmt::format("a read-only token may call GetStatus and WatchEvents only (trnctl status, watch, "
                      "checkpoints); {} needs the admin token or its job's token",
                      name));
    }
  }
  v1::GetStatusRequest all;
  CHECK(raw.call(kReader, &v1::Coordinator::Stub::GetStatus, all).ok());
  CHECK(raw.watch(kReader, "").ok());
  auto st = job_status(admin, "a");
  CHECK(st.state() == "running");
  CHECK(st.restarts() == 0);
  CHECK(st.progress().reporting() == 0);

  // trnctl with the read-only token: status and checkpoints of every job.
  auto r = test::run_all({{{test::bin("trnctl"), "--coordinator", s.coord->address(), "--token-file",
                            s.dir.path() + "/reader", "checkpoints", "a"},
                           {}}},
                         30s)[0];
  INFO(r.describe());
  CHECK(r.exit_code == 0);
}

TEST_CASE(
    "tokens: a job's token still works after kill -9 and a restart from --state-dir; none is logged or "
    "saved") {
  Secured s;
  auto admin = s.client(kAdmin);
  const std::string a = admin.join(test::single_node("a")).job_token;
  const std::string b = admin.join(test::single_node("b")).job_token;
  auto worker = s.client(a);
  worker.store("a", 0)->set("k", "v");
  CHECK(worker.report_shard("a", 0, {3, 0, "/ckpt/3", 1, ""}) == 3);

  s.coord->kill9();
  s.coord->restart_same_port();

  CHECK_FALSE(worker.heartbeat("a", 0, {0, "h", 7, 4, 1.0, 1.0}).abort);
  CHECK(worker.report_shard("a", 0, {6, 0, "/ckpt/6", 1, ""}) == 6);
  CHECK(job_status(worker, "a").last_committed_step() == 6);
  Raw raw(s.coord->address());
  for (auto& [name, call] : calls_on(raw, "b"))
    if (name == "Set" || name == "Heartbeat" || name == "GetStatus")
      check_refused(call(a), grpc::StatusCode::PERMISSION_DENIED,
                    "the token of job 'a' may act on that job only");
  // A member's repeated join (a node that reconnects) gets the same token from the restarted coordinator.
  CHECK(admin.join(test::single_node("a")).job_token == a);
  CHECK(admin.join(test::single_node("b")).job_token == b);

  // No token reaches the log (at debug level), a status reply, /metrics or the state on disk.
  v1::GetStatusRequest all;
  v1::GetStatusResponse resp;
  REQUIRE(raw.call(kAdmin, &v1::Coordinator::Stub::GetStatus, all, &resp).ok());
  const std::string status = resp.SerializeAsString();
  const std::string metrics = test::http_get(s.metrics_port, "/metrics");
  REQUIRE_THAT(metrics, Catch::StartsWith("HTTP/1.1 200 OK"));
  std::string state;
  for (const auto& f : std::filesystem::recursive_directory_iterator(s.dir.path() + "/state"))
    if (f.is_regular_file()) state += slurp(f.path());
  REQUIRE_FALSE(state.empty());
  const std::string log = s.coord->log();
  for (const std::string& secret : {a, b, kAdmin, kReader}) {
    INFO(secret);
    CHECK(log.find(secret) == std::string::npos);
    CHECK(status.find(secret) == std::string::npos);
    CHECK(metrics.find(secret) == std::string::npos);
    CHECK(state.find(secret) == std::string::npos);
  }
}

TEST_CASE(
    "tokens: --read-token-file without --token-file, empty, or the admin token's twin is one line, exit 2") {
  test::TempDir dir;
  const std::string d = dir.path();
  std::ofstream(d + "/admin") << "same\n";
  std::ofstream(d + "/twin") << "same\n";
  std::ofstream(d + "/empty") << "\n";
  const std::string c = test::bin("trn-coordinator") + " --listen 127.0.0.1:0 ";
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--read-token-file " + d + "/twin", "--read-token-file needs --token-file"},
           {"--token-file " + d + "/admin --read-token-file " + d + "/empty", "is empty"},
           {"--token-file " + d + "/admin --read-token-file " + d + "/twin", "holds the admin token"},
           {"--token-file " + d + "/admin --read-token-file " + d + "/missing", "cannot read"},
       }) {
    INFO(args);
    auto r = test::run_all({{{"/bin/sh", "-c", c + args}, {}}}, 30s)[0];
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::StartsWith("trn-coordinator: error: ") && Catch::Contains(needle));
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
}
