// trn-coordinator's serving surface: Prometheus metrics, gRPC health, TLS and mTLS, SIGTERM.
#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include "collectives/core/error.h"
#include "launcher/client/coordinator_client.h"
#include "tests/integration/coordinator/helpers.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

JoinRequest single(const std::string& job) { return test::single_node(job, 1, 10s); }

}  // namespace

TEST_CASE("metrics endpoint serves Prometheus text with job gauges and RPC counts") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  ClientOptions o;
  o.address = coord.address();
  CoordinatorClient client(o);
  auto j = client.join(single("metered"));
  WorkerProgress beat{0, "h", 1, 7, 1.5, 10};
  beat.val_loss = 1.25;  // trn-train --val-data: the job's gauge
  client.heartbeat("metered", j.generation, beat);
  client.report_shard("metered", j.generation, {5, 0, "/p", 1, ""});
  auto page = test::http_get(mport, "/metrics");
  INFO(page);
  CHECK_THAT(page, Catch::StartsWith("HTTP/1.1 200 OK"));
  CHECK_THAT(page, Catch::Contains("trn_coordinator_jobs 1\n"));
  CHECK_THAT(page, Catch::Contains("trn_job_generation{job=\"metered\",state=\"running\"} 0\n"));
  CHECK_THAT(page, Catch::Contains("trn_job_members{job=\"metered\"} 1\n"));
  CHECK_THAT(page, Catch::Contains("trn_job_last_committed_step{job=\"metered\"} 5\n"));
  CHECK_THAT(page, Catch::Contains("trn_coordinator_heartbeats_total 1\n"));
  CHECK_THAT(page, Catch::Contains("trn_coordinator_rpcs_total{method=\"Join\",code=\"OK\"} 1\n"));
  CHECK_THAT(page, Catch::Contains("trn_coordinator_rpc_seconds_bucket{method=\"Heartbeat\",le=\"+Inf\"} 1\n"));
  CHECK_THAT(page, Catch::Contains("trn_job_restarts_total{job=\"metered\"} 0\n"));
  CHECK_THAT(page, Catch::Contains("trn_job_val_loss{job=\"metered\"} 1.25\n"));
  CHECK_THAT(test::http_get(mport, "/other"), Catch::StartsWith("HTTP/1.1 404"));
}

TEST_CASE("metrics: a job's in-place recoveries as per-job series, and the page passes promtool check metrics") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  ClientOptions o;
  o.address = coord.address();
  CoordinatorClient client(o);
  auto j = client.join(single("recovering"));
  client.join(single("steady"));
  auto page = test::http_get(mport, "/metrics");
  CHECK_THAT(page, !Catch::Contains("trn_job_recoveries_total"));  // nobody reported one yet
  WorkerProgress beat{0, "h", 1, 1201, 1.5, 10};
  beat.recovery = RecoveryReport{2, 0.12, 0.3, 0.45, 1200, 1, 4, 1, 0.965};
  client.heartbeat("recovering", j.generation, beat);
  client.heartbeat("steady", 0, WorkerProgress{0, "h", 2, 7, 1.5, 10});
  page = test::http_get(mport, "/metrics");
  INFO(page);
  CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_recoveries_total counter\ntrn_job_recoveries_total{job=\"recovering\"} 2\n"));
  CHECK_THAT(page, Catch::Contains("\ntrn_job_last_recovery_seconds{job=\"recovering\"} 0.45\n"));
  CHECK_THAT(page, Catch::Contains("\ntrn_job_steps_lost_total{job=\"recovering\"} 4\n"));
  CHECK_THAT(page, Catch::Contains("\ntrn_job_goodput_ratio{job=\"recovering\"} 0.965\n"));
  CHECK_THAT(page, !Catch::Contains("recoveries_total{job=\"steady\"}") && !Catch::Contains("goodput_ratio{job=\"steady\"}"));

  // The whole page is valid exposition text (and lints clean) by Prometheus's own parser.
  const std::string promtool = "/usr/bin/promtool";
  if (::access(promtool.c_str(), X_OK) != 0) {
    WARN("promtool is not installed (deploy/install-deps.sh installs prometheus): exposition not checked");
    return;
  }
  const std::string body = page.substr(page.find("\r\n\r\n") + 4);
  const std::string file = dir.path() + "/metrics.txt";
  {
    std::ofstream out(file);
    out << body;
  }
  auto check = test::run_all({{{"/bin/sh", "-c", promtool + " check metrics < " + file}, {}}}, 30s)[0];
  INFO(check.describe());
  CHECK(check.exit_code == 0);
}

TEST_CASE("metrics: rank 0's MoE figures per job and layer, bounded, and none for a dense job") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  ClientOptions o;
  o.address = coord.address();
  CoordinatorClient client(o);
  auto j = client.join(test::single_node("mixture", 2, 10s));
  client.join(single("dense"));
  client.heartbeat("dense", 0, WorkerProgress{0, "h", 3, 7, 1.5, 10});
  CHECK_THAT(test::http_get(mport, "/metrics"), !Catch::Contains("trn_job_moe_"));  // no MoE job yet

  // As trnrun forwards them: rank 0's figures are the job's; another rank's are not read.
  ForwardedHeartbeat r0, r1;
  r0.progress = WorkerProgress{0, "h", 1, 5, 2.5, 10};
  r0.progress.moe = MoeReport{2.0625, {1.5, 3.25}, {0, 2}, 17};
  r1.progress = WorkerProgress{1, "h", 2, 5, 2.5, 10};
  r1.progress.moe = MoeReport{9, {9, 9, 9}, {9, 9, 9}, 9};
  client.node_heartbeat("mixture", j.generation, 0, {r0, r1}, "h");
  auto page = test::http_get(mport, "/metrics");
  {
    INFO(page);
    CHECK_THAT(page, Catch::Contains("\n# TYPE trn_job_moe_aux_loss gauge\ntrn_job_moe_aux_loss{job=\"mixture\"} 2.0625\n"));
    CHECK_THAT(page, Catch::Contains("\ntrn_job_moe_max_mean{job=\"mixture\",layer=\"0\"} 1.5\n"
                                     "trn_job_moe_max_mean{job=\"mixture\",layer=\"1\"} 3.25\n#"));
    CHECK_THAT(page, Catch::Contains("\ntrn_job_moe_dead_experts{job=\"mixture\",layer=\"0\"} 0\n"
                                     "trn_job_moe_dead_experts{job=\"mixture\",layer=\"1\"} 2\n#"));
    CHECK_THAT(page, Catch::Contains("\ntrn_job_moe_dropped{job=\"mixture\"} 17\n"));
    CHECK_THAT(page, !Catch::Contains("job=\"dense\",layer") && !Catch::Contains("trn_job_moe_aux_loss{job=\"dense\"}"));
  }

  // A figure that cannot be true is ignored (the heartbeat still counts): the last good one stays.
  WorkerProgress bad{0, "h", 1, 6, 2.5, 10};
  bad.moe = MoeReport{1, {-1, 2}, {0, 0}, 0};
  client.heartbeat("mixture", j.generation, bad);
  page = test::http_get(mport, "/metrics");
  CHECK_THAT(page, Catch::Contains("trn_job_moe_aux_loss{job=\"mixture\"} 2.0625\n"));

  // A deeper model than kMaxMoeLayers: its first 512 layers go on the wire.
  WorkerProgress deep{0, "h", 1, 7, 2.5, 10};
  deep.moe = MoeReport{0.5, std::vector<double>(kMaxMoeLayers + 88, 1.25),
                       std::vector<int32_t>(kMaxMoeLayers + 88, 1), 0};
  client.heartbeat("mixture", j.generation, deep);
  page = test::http_get(mport, "/metrics");
  CHECK_THAT(page, Catch::Contains("trn_job_moe_aux_loss{job=\"mixture\"} 0.5\n"));
  CHECK_THAT(page, Catch::Contains(fmt::format("trn_job_moe_max_mean{{job=\"mixture\",layer=\"{}\"}} 1.25\n",
                                               kMaxMoeLayers - 1)));
  CHECK_THAT(page, !Catch::Contains(fmt::format("layer=\"{}\"", kMaxMoeLayers)));
}

TEST_CASE("the gRPC health service answers SERVING") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  auto channel = grpc::CreateChannel(coord.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::ByteBuffer req, resp;  // HealthCheckRequest{service: ""} is empty on the wire
  grpc::Slice empty("", 0);
  req = grpc::ByteBuffer(&empty, 1);
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                 [&](grpc::Status s) { done.set_value(s); });
  auto s = done.get_future().get();
  REQUIRE(s.ok());
  std::vector<grpc::Slice> slices;
  REQUIRE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  CHECK(bytes == std::string("\x08\x01", 2));  // status: SERVING
}

TEST_CASE("requests that are not valid protobuf are refused without a log line each") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  auto channel = grpc::CreateChannel(coord.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  // GetStatusRequest{job_id: "\xff\xfe"}: a string that is not UTF-8, which protobuf refuses to
  // parse, reporting it through its own log; then a message cut short.
  for (const std::string& wire : {std::string("\x0a\x02\xff\xfe", 4), std::string("\x0a\x09job", 5)}) {
    for (int i = 0; i < 20; ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + 10s);
      grpc::Slice slice(wire);
      grpc::ByteBuffer req(&slice, 1), resp;
      std::promise<grpc::Status> done;
      stub.UnaryCall(&ctx, "/trn.coordinator.v1.Coordinator/GetStatus", grpc::StubOptions(), &req, &resp,
                     [&](grpc::Status s) { done.set_value(s); });
      const grpc::Status s = done.get_future().get();
      INFO(s.error_message());
      CHECK_FALSE(s.ok());
    }
  }
  REQUIRE(coord.running());
  // Forty refusals of a client's bytes are not forty lines of the coordinator's log: protobuf's
  // reports of them are at the debug level only, never in its own format.
  const std::string log = coord.log();
  CHECK_THAT(log, !Catch::Contains("libprotobuf"));
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);)
    if (line.find("protobuf") != std::string::npos || line.find("UTF-8") != std::string::npos) {
      INFO(line);
      CHECK(line.find(" debug [") != std::string::npos);
    }
}

TEST_CASE("TLS with client certificates: a verified client is served, others are not") {
  test::TempDir dir;
  const std::string d = dir.path();
  std::string script = fmt::format(
      "set -e; cd {0}; "
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=trn-test-ca -keyout ca.key -out ca.pem; "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout server.key -out server.csr; "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' > san.ext; "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -extfile san.ext "
      "-out server.pem; "
      "openssl req -newkey rsa:2048 -nodes -subj /CN=worker -keyout client.key -out client.csr; "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out client.pem",
      d);
  auto gen = test::run_all({{{"/bin/sh", "-c", script}, {}}}, 60s);
  REQUIRE(gen[0].ok());
  test::CoordinatorProcess coord(d, {"--tls-cert", d + "/server.pem", "--tls-key", d + "/server.key",
                                     "--tls-client-ca", d + "/ca.pem"});
  ClientOptions o;
  o.address = coord.address();
  o.rpc_timeout = 3s;
  o.tls_ca_file = d + "/ca.pem";
  o.tls_cert_file = d + "/client.pem";
  o.tls_key_file = d + "/client.key";
  CoordinatorClient good(o);
  CHECK(good.join(single("secure")).world_size == 1);
  // TLS without tokens: no heartbeat datagrams (nothing could authenticate them); a node
  // heartbeat goes over TLS.
  CHECK_FALSE(good.node_heartbeat("secure", 0, 0, {}, "h").abort);
  CHECK_THAT(coord.log(), Catch::Contains("TLS without --token-file: node heartbeats go over gRPC only"));

  ClientOptions no_cert = o;
  no_cert.tls_cert_file.clear();
  no_cert.tls_key_file.clear();
  CoordinatorClient anonymous(no_cert);
  CHECK_THROWS_AS(anonymous.heartbeat("secure", 0, {0, "h", 1, 0, 0, 0}), Error);

  ClientOptions plain;
  plain.address = coord.address();
  plain.rpc_timeout = 2s;
  CoordinatorClient plaintext(plain);
  CHECK_THROWS_AS(plaintext.heartbeat("secure", 0, {0, "h", 1, 0, 0, 0}), Error);
  REQUIRE(coord.running());
}

TEST_CASE("SIGTERM stops the coordinator cleanly, ending waiting calls") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {"--state-dir", dir.path() + "/state"});
  ClientOptions o;
  o.address = coord.address();
  o.rpc_timeout = 3s;
  CoordinatorClient client(o);
  JoinRequest r = single("waiting");
  r.min_nodes = r.max_nodes = 2;
  r.deadline = Deadline::after(4s);
  auto waiting = std::async(std::launch::async, [&] { return client.join(r); });
  std::this_thread::sleep_for(500ms);
  auto res = coord.terminate();
  CHECK(res.exit_code == 0);
  CHECK_FALSE(res.timed_out);
  try {
    waiting.get();
    FAIL("join completed without a second node");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kRemote);  // the coordinator went away and never came back
    CHECK_THAT(e.what(), Catch::Contains("unreachable"));
  }
  CHECK_THAT(coord.log(), Catch::Contains("trn-coordinator stopped"));
}

TEST_CASE("bad flags end trn-coordinator with one clear line and exit code 2") {
  for (std::string args : {"--listen nonsense", "--heartbeat-timeout -1", "--tls-cert x.pem", "--frobnicate",
                           "--token-file /nonexistent/token"}) {
    auto rs = test::run_all({{{"/bin/sh", "-c", test::bin("trn-coordinator") + " " + args}, {}}}, 20s);
    INFO(args << ": " << rs[0].describe());
    CHECK(rs[0].exit_code == 2);
    CHECK_THAT(rs[0].output, Catch::StartsWith("trn-coordinator: error: "));
  }
}

TEST_CASE("server reflection lists the coordinator service") {
  test::TempDir dir;
  test::CoordinatorProcess coord(dir.path(), {});
  auto channel = grpc::CreateChannel(coord.address(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + 10s);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto step = [&](int tag) {
    void* got = nullptr;
    bool ok = false;
    REQUIRE(cq.Next(&got, &ok));
    REQUIRE(got == reinterpret_cast<void*>(static_cast<intptr_t>(tag)));
    return ok;
  };
  auto tag = [](int t) { return reinterpret_cast<void*>(static_cast<intptr_t>(t)); };
  call->StartCall(tag(1));
  REQUIRE(step(1));
  grpc::Slice req_bytes(std::string("\x3a\x00", 2));  // ServerReflectionRequest{list_services: ""}
  grpc::ByteBuffer req(&req_bytes, 1), resp;
  call->Write(req, tag(2));
  REQUIRE(step(2));
  call->Read(&resp, tag(3));
  REQUIRE(step(3));
  call->WritesDone(tag(4));
  step(4);
  grpc::Status st;
  call->Finish(&st, tag(5));
  step(5);
  cq.Shutdown();
  std::vector<grpc::Slice> slices;
  REQUIRE(resp.Dump(&slices).ok());
  std::string bytes;
  for (auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  CHECK_THAT(bytes, Catch::Contains("trn.coordinator.v1.Coordinator"));
  CHECK_THAT(bytes, Catch::Contains("grpc.health.v1.Health"));
}
