// Node heartbeats as datagrams: the wire format, the coordinator's handling (CoordinatorService::
// heartbeat_datagram on a registry with tokens), and both ends over real UDP sockets on loopback
// (DatagramServer, DatagramHeartbeats).
#include "launcher/client/heartbeat_datagram.h"

#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "launcher/client/datagram_heartbeats.h"
#include "launcher/server/datagram_server.h"
#include "launcher/server/metrics.h"
#include "launcher/server/registry.h"
#include "launcher/server/service.h"

using namespace trn;
using namespace trn::control;
using namespace std::chrono_literals;

namespace {

// A registry with tokens and one running job "j" of 2 nodes x 2 ranks, and its service.
struct Coordinator {
  RpcMetrics metrics;
  Registry registry;
  CoordinatorService service;
  std::string job_token;

  static RegistryOptions options() {
    RegistryOptions o;
    o.job_token_key = "admin";
    return o;
  }
  Coordinator() : registry(options()), service(registry, metrics, "admin") {
    for (int node = 0; node < 2; ++node) {
      v1::JoinRequest q;
      q.set_job_id("j");
      q.set_node_id("node" + std::to_string(node));
      q.set_host("h");
      q.set_nproc_per_node(2);
      q.set_min_nodes(2);
      q.set_max_nodes(2);
      q.set_timeout_ms(1000);
      registry.join(q, [this](const Status& s, v1::JoinResponse r) {
        REQUIRE(s.ok());
        job_token = r.job_token();
      });
    }
    REQUIRE(job_token.size() == 64);
  }
  int64_t step_of(int rank) {
    v1::GetStatusRequest q;
    q.set_job_id("j");
    v1::GetStatusResponse r;
    REQUIRE(registry.status(q, &r).ok());
    REQUIRE(r.jobs(0).workers_size() == 4);
    return r.jobs(0).workers(rank).step();
  }
  std::string count(const char* code) {
    const std::string page = metrics.render(registry.gauges());
    const std::string key =
        fmt::format("trn_coordinator_rpcs_total{{method=\"HeartbeatDatagram\",code=\"{}\"}} ", code);
    auto at = page.find(key);
    return at == std::string::npos ? "0"
                                   : page.substr(at + key.size(), page.find('\n', at) - at - key.size());
  }
};

v1::HeartbeatRequest node_heartbeat(int node, int64_t step) {
  v1::HeartbeatRequest q;
  q.set_job_id("j");
  q.set_kind(v1::HeartbeatRequest::NODE);
  q.set_rank(node);
  q.set_host("h");
  for (int r = node * 2; r < node * 2 + 2; ++r) {
    auto* e = q.add_ranks();
    e->set_rank(r);
    e->set_step(step);
  }
  return q;
}

// A coordinator without tokens and one running job "open" of one node of `ranks` ranks.
struct OpenCoordinator {
  RpcMetrics metrics;
  Registry registry{RegistryOptions{}};
  CoordinatorService service{registry, metrics, ""};
  explicit OpenCoordinator(int ranks) {
    v1::JoinRequest q;
    q.set_job_id("open");
    q.set_node_id("n");
    q.set_host("h");
    q.set_nproc_per_node(ranks);
    q.set_min_nodes(1);
    q.set_max_nodes(1);
    registry.join(q, [](const Status& s, v1::JoinResponse) { REQUIRE(s.ok()); });
  }
};

}  // namespace

TEST_CASE("a heartbeat datagram parses back to what was encoded, with or without a MAC") {
  for (std::string key : {"", "k"}) {
    auto bytes = encode_datagram(DatagramType::kReply, 0x0102030405060708ull, 77, "payload", key);
    REQUIRE(bytes);
    CHECK(bytes->size() == kDatagramHeader + 7 + (key.empty() ? 0 : kDatagramMac));
    std::string why;
    auto d = parse_datagram(*bytes, &why);
    REQUIRE(d);
    CHECK(d->type == DatagramType::kReply);
    CHECK(d->seq == 0x0102030405060708ull);
    CHECK(d->epoch == 77);
    CHECK(d->payload == "payload");
    CHECK(datagram_mac_ok(*d, key));
    CHECK(datagram_mac_ok(*d, key.empty() ? "k" : "") == false);
  }
  CHECK_FALSE(encode_datagram(DatagramType::kRequest, 1, 1, std::string(kMaxDatagram, 'x'), ""));
}

TEST_CASE("a reply's MAC covers its request's: it answers that request and no other") {
  const auto a = *encode_datagram(DatagramType::kRequest, 5, 1, "node 0", "k");
  const auto b = *encode_datagram(DatagramType::kRequest, 5, 1, "node 1", "k");
  const auto reply = *encode_datagram(DatagramType::kReply, 5, 1, "abort", "k", mac_of(a, true));
  auto d = parse_datagram(reply, nullptr);
  REQUIRE(d);
  CHECK(datagram_mac_ok(*d, "k", mac_of(a, true)));
  CHECK_FALSE(datagram_mac_ok(*d, "k", mac_of(b, true)));
  CHECK_FALSE(datagram_mac_ok(*d, "k"));
}

TEST_CASE("a heartbeat datagram's MAC is HMAC-SHA256 of its header and payload under the key") {
  // The bytes as the header comment lays them out, and the MAC an independent HMAC-SHA256
  // (Python's hmac module) computes over them with the key "Jefe".
  const std::string header(
      "TRNH\x01\x01\x01\x00\x01\x00\x00\x00\x00\x00\x00\x00\x88\x77\x66\x55\x44\x33\x22\x11"
      "\x03\x00\x00\x00",
      28);
  const std::string mac =
      "\x22\x4c\xe4\x5a\x05\xd4\x9f\xbc\xbf\x4c\xbf\x79\x84\x0d\xff\x24"
      "\x87\x0f\x43\x90\xc7\xcc\x98\xce\xd3\xd4\x4b\x17\xbe\x4c\x0d\xc0";
  auto bytes = encode_datagram(DatagramType::kRequest, 1, 0x1122334455667788ull, "abc", "Jefe");
  REQUIRE(bytes);
  CHECK(*bytes == header + "abc" + mac);
}

TEST_CASE("a malformed heartbeat datagram is refused with its reason") {
  const std::string good = *encode_datagram(DatagramType::kRequest, 5, 1, "abc", "k");
  auto reason = [](std::string bytes) {
    std::string why;
    return parse_datagram(bytes, &why) ? std::string("accepted") : why;
  };
  CHECK(reason(good.substr(0, 27)) == "shorter than the header");
  CHECK(reason("XRNH" + good.substr(4)) == "not a heartbeat datagram (bad magic)");
  std::string v = good;
  v[4] = 2;
  CHECK(reason(v) == "unknown version");
  v = good;
  v[5] = 3;
  CHECK(reason(v) == "unknown type");
  CHECK(reason(good + "x") == "length does not match the header");
  CHECK(reason(good.substr(0, good.size() - 1)) == "length does not match the header");
  v = good;
  v[6] = 0;  // claims no MAC: the 32 MAC bytes are then extra
  CHECK(reason(v) == "length does not match the header");
  CHECK(reason(*encode_datagram(DatagramType::kRequest, 0, 1, "abc", "")) == "sequence 0");
  // A byte changed anywhere the MAC covers fails the MAC, not the parse.
  v = good;
  v[29] ^= 1;
  auto d = parse_datagram(v, nullptr);
  REQUIRE(d);
  CHECK_FALSE(datagram_mac_ok(*d, "k"));
}

TEST_CASE("the coordinator answers a node heartbeat datagram only with its job token's MAC, and once") {
  Coordinator c;
  const uint64_t e = c.service.datagram_epoch();
  const auto payload = node_heartbeat(1, 7).SerializeAsString();
  // No MAC, or another key's: dropped, nothing recorded.
  CHECK_FALSE(c.service.heartbeat_datagram(*encode_datagram(DatagramType::kRequest, 10, e, payload, "")));
  CHECK_FALSE(
      c.service.heartbeat_datagram(*encode_datagram(DatagramType::kRequest, 10, e, payload, "admin")));
  CHECK(c.step_of(2) == 0);
  CHECK(c.count("UNAUTHENTICATED") == "2");

  const auto good = *encode_datagram(DatagramType::kRequest, 10, e, payload, c.job_token);
  auto answer = c.service.heartbeat_datagram(good);
  REQUIRE(answer);
  auto d = parse_datagram(*answer, nullptr);
  REQUIRE(d);
  CHECK(d->type == DatagramType::kReply);
  CHECK(d->seq == 10);
  CHECK(d->epoch == e);
  CHECK(datagram_mac_ok(*d, c.job_token, mac_of(good, true)));
  v1::HeartbeatResponse resp;
  REQUIRE(resp.ParseFromArray(d->payload.data(), static_cast<int>(d->payload.size())));
  CHECK_FALSE(resp.abort());
  CHECK(c.step_of(2) == 7);
  CHECK(c.step_of(3) == 7);

  // The same datagram again (a replay) is dropped; the next sequence number is answered.
  CHECK_FALSE(c.service.heartbeat_datagram(good));
  CHECK(c.count("FAILED_PRECONDITION") == "1");
  CHECK(c.service.heartbeat_datagram(*encode_datagram(
      DatagramType::kRequest, 11, e, node_heartbeat(1, 8).SerializeAsString(), c.job_token)));
  CHECK(c.step_of(2) == 8);
  CHECK(c.count("OK") == "2");

  // A reply, a worker heartbeat, or a payload that is no HeartbeatRequest: dropped.
  CHECK_FALSE(
      c.service.heartbeat_datagram(*encode_datagram(DatagramType::kReply, 12, e, payload, c.job_token)));
  v1::HeartbeatRequest worker = node_heartbeat(1, 9);
  worker.set_kind(v1::HeartbeatRequest::WORKER);
  worker.clear_ranks();
  CHECK_FALSE(c.service.heartbeat_datagram(
      *encode_datagram(DatagramType::kRequest, 13, e, worker.SerializeAsString(), c.job_token)));
  CHECK_FALSE(
      c.service.heartbeat_datagram(*encode_datagram(DatagramType::kRequest, 14, e, "\xff\xff", c.job_token)));
  CHECK(c.count("INVALID_ARGUMENT") == "3");
}

TEST_CASE("a datagram of another epoch is dropped: a replay after a new leader's election records nothing") {
  Coordinator c;
  const uint64_t before = c.service.datagram_epoch();
  const auto sent = *encode_datagram(DatagramType::kRequest, 10, before,
                                     node_heartbeat(1, 7).SerializeAsString(), c.job_token);
  REQUIRE(c.service.heartbeat_datagram(sent));
  // A leader elected restores the registry (no sequence numbers) and draws a new epoch.
  v1::Snapshot snap = c.registry.snapshot();
  c.registry.restore(snap);
  c.service.new_datagram_epoch();
  CHECK(c.service.datagram_epoch() != before);
  CHECK_FALSE(c.service.heartbeat_datagram(sent));
  CHECK_FALSE(c.service.heartbeat_datagram(*encode_datagram(
      DatagramType::kRequest, 11, before, node_heartbeat(1, 8).SerializeAsString(), c.job_token)));
  CHECK(c.count("FAILED_PRECONDITION") == "2");
  // In the new epoch (which the agent learns from its gRPC fallback) datagrams count again.
  CHECK(
      c.service.heartbeat_datagram(*encode_datagram(DatagramType::kRequest, 12, c.service.datagram_epoch(),
                                                    node_heartbeat(1, 9).SerializeAsString(), c.job_token)));
  CHECK(c.step_of(2) == 9);
}

TEST_CASE("without tokens a datagram's answer is never longer than the datagram") {
  OpenCoordinator c(2);
  auto& service = c.service;
  const uint64_t e = service.datagram_epoch();
  v1::HeartbeatRequest beat;
  beat.set_job_id("open");
  beat.set_kind(v1::HeartbeatRequest::NODE);
  for (int r = 0; r < 2; ++r) {
    auto* x = beat.add_ranks();
    x->set_rank(r);
    x->set_step(3);
  }
  auto answer = service.heartbeat_datagram(
      *encode_datagram(DatagramType::kRequest, 1, e, beat.SerializeAsString(), ""));
  REQUIRE(answer);
  // A short request whose answer is a long abort (a job this coordinator does not know): no
  // answer; the agent hears it over gRPC, which cannot be sent from a forged address.
  v1::HeartbeatRequest unknown;
  unknown.set_job_id("x");
  unknown.set_kind(v1::HeartbeatRequest::NODE);
  const auto small = *encode_datagram(DatagramType::kRequest, 2, e, unknown.SerializeAsString(), "");
  CHECK_FALSE(service.heartbeat_datagram(small));
}

TEST_CASE("an agent pads a datagram without a MAC to the least size, and nothing else changes") {
  for (size_t hosts = 0; hosts < 600; ++hosts) {
    v1::HeartbeatRequest q;
    q.set_job_id("j");
    q.set_kind(v1::HeartbeatRequest::NODE);
    q.set_host(std::string(hosts, 'h'));
    const std::string plain = q.SerializeAsString();
    INFO("payload of " << plain.size() << " bytes");
    CHECK(DatagramHeartbeats::padded_payload(q, true) == plain);
    const std::string padded = DatagramHeartbeats::padded_payload(q, false);
    const size_t want = DatagramHeartbeats::kMinUnkeyedRequest - kDatagramHeader;
    if (plain.size() >= want) {
      CHECK(padded == plain);
      continue;
    }
    CHECK(padded.size() >= want);
    CHECK(padded.size() <= want + 1);
    v1::HeartbeatRequest back;
    REQUIRE(back.ParseFromString(padded));
    CHECK(back.padding().size() + plain.size() + 3 >= padded.size());
    back.clear_padding();
    CHECK(back.SerializeAsString() == plain);
  }
}

TEST_CASE("without tokens an agent's heartbeat with no rank entries is answered, an abort included") {
  OpenCoordinator c(1);
  auto& registry = c.registry;
  auto& service = c.service;
  DatagramServer server("127.0.0.1", 0, 1, [&](std::string_view b) { return service.heartbeat_datagram(b); });
  DatagramHeartbeats agent;
  agent.configure("open", "", "127.0.0.1:1", server.port(), service.datagram_epoch());
  // The shortest node heartbeat an agent sends (its workers sent nothing since the last one);
  // unpadded, its answer (the port and a random 64-bit epoch) can be the longer.
  v1::HeartbeatRequest beat;
  beat.set_job_id("open");
  beat.set_kind(v1::HeartbeatRequest::NODE);
  for (int i = 0; i < 20; ++i) {
    auto answer = agent.exchange(beat, 5s);
    REQUIRE(answer);
    CHECK_FALSE(answer->abort());
    service.new_datagram_epoch();  // another epoch, another length of its varint
    agent.configure("open", "", "127.0.0.1:1", server.port(), service.datagram_epoch());
  }
  v1::ReportFailureRequest failure;
  failure.set_job_id("open");
  failure.set_reason(std::string(200, 'x'));
  v1::ReportFailureResponse ignored;
  REQUIRE(registry.report_failure(failure, &ignored).ok());
  auto abort = agent.exchange(beat, 5s);
  REQUIRE(abort);
  CHECK(abort->abort());
  CHECK_THAT(abort->reason(), Catch::Contains(std::string(200, 'x')));
}

TEST_CASE("an agent's heartbeat datagram reaches the coordinator's socket and its answer comes back") {
  Coordinator c;
  DatagramServer server("127.0.0.1", 0, 2,
                        [&](std::string_view b) { return c.service.heartbeat_datagram(b); });
  REQUIRE(server.port() > 0);
  DatagramHeartbeats agent;
  agent.configure("j", c.job_token, "127.0.0.1:1", server.port(), c.service.datagram_epoch());
  for (int64_t step = 1; step <= 3; ++step) {
    auto answer = agent.exchange(node_heartbeat(0, step), 5s);
    REQUIRE(answer);
    CHECK_FALSE(answer->abort());
    CHECK(c.step_of(0) == step);
  }
  // Another job's heartbeat is not sent as a datagram: the caller uses gRPC.
  auto other = node_heartbeat(0, 4);
  other.set_job_id("k");
  CHECK_FALSE(agent.exchange(other, 5s));
  // A key the coordinator does not hold: no answer within the wait.
  agent.configure("j", "not the job token", "127.0.0.1:1", server.port(), c.service.datagram_epoch());
  CHECK_FALSE(agent.exchange(node_heartbeat(0, 5), 200ms));
  CHECK(c.step_of(0) == 3);
}

TEST_CASE("a datagram over the largest heartbeat is dropped and counted as too long, not silently") {
  Coordinator c;
  DatagramServer server("127.0.0.1", 0, 1, [&](std::string_view b) { return c.service.heartbeat_datagram(b); });
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(server.port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Two over kMaxDatagram (the receive buffer holds one byte more, so they arrive truncated) and
  // one of exactly kMaxDatagram, which is read whole and is merely malformed.
  for (size_t bytes : {kMaxDatagram + 1, size_t{65000}, kMaxDatagram}) {
    const std::string d(bytes, 'x');
    REQUIRE(::sendto(fd, d.data(), d.size(), 0, reinterpret_cast<const sockaddr*>(&to), sizeof to) ==
            static_cast<ssize_t>(d.size()));
  }
  ::close(fd);
  const auto until = std::chrono::steady_clock::now() + 10s;
  while ((c.count("OUT_OF_RANGE") != "2" || c.count("INVALID_ARGUMENT") != "1") &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);
  CHECK(c.count("OUT_OF_RANGE") == "2");
  CHECK(c.count("INVALID_ARGUMENT") == "1");
  // The handler alone counts it the same way.
  CHECK_FALSE(c.service.heartbeat_datagram(std::string(kMaxDatagram + 1, 'x')));
  CHECK(c.count("OUT_OF_RANGE") == "3");
}

TEST_CASE("datagrams the kernel drops for want of buffer room are counted: each one sent is handled or counted") {
  // The one reader blocks in the handler on the first datagram while far more than the receive
  // buffer holds arrive; released, it reads what the buffer kept, and the next datagram it reads
  // carries the kernel's drop count.
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<uint64_t> handled{0}, dropped{0};
  DatagramServer server(
      "127.0.0.1", 0, 1,
      [&](std::string_view) -> std::optional<std::string> {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return release; });
        ++handled;
        return std::nullopt;
      },
      [&](const char* why, uint64_t n) {
        if (std::string(why) == DatagramServer::kReceiveBufferFull) dropped += n;
      });
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(server.port()));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const std::string d(1024, 'x');
  uint64_t sent = 0;
  auto send_one = [&] {
    if (::sendto(fd, d.data(), d.size(), 0, reinterpret_cast<const sockaddr*>(&to), sizeof to) ==
        static_cast<ssize_t>(d.size()))
      ++sent;
  };
  // Each datagram takes more than its 1 KiB of the buffer, so this is at least twice its room.
  const uint64_t flood = 2 * static_cast<uint64_t>(server.receive_buffer_bytes()) / d.size() + 1000;
  for (uint64_t i = 0; i < flood; ++i) {
    send_one();
    // Now and then a pause, so the loopback device's own queue (netdev_max_backlog) drains under
    // load: only the socket's buffer should overflow here.
    if (i % 256 == 255) std::this_thread::sleep_for(1ms);
  }
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (handled + dropped < sent && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(20ms);
    send_one();  // carries the drop count once the buffer has drained
  }
  ::close(fd);
  INFO("sent " << sent << ", handled " << handled << ", dropped " << dropped);
  CHECK(dropped > 0);
  CHECK(handled + dropped == sent);
}

TEST_CASE("heartbeat datagrams that go unanswered make the agent use gRPC for a while, then try again") {
  // A socket that reads and never answers stands for a coordinator behind a UDP filter.
  int silent = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  REQUIRE(silent >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(silent, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(silent, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  auto received = [&] {
    int n = 0;
    char buf[kMaxDatagram];
    while (::recv(silent, buf, sizeof buf, MSG_DONTWAIT) >= 0) ++n;
    return n;
  };
  DatagramHeartbeats agent;
  agent.configure("j", "", "127.0.0.1:1", ntohs(a.sin_port), 1);
  for (int i = 0; i < DatagramHeartbeats::kMissesToBackOff; ++i)
    CHECK_FALSE(agent.exchange(node_heartbeat(0, i), 50ms));
  CHECK(received() == DatagramHeartbeats::kMissesToBackOff);
  // Backing off: nothing is sent.
  for (int i = 0; i < DatagramHeartbeats::kBackOffCalls; ++i)
    CHECK_FALSE(agent.exchange(node_heartbeat(0, i), 5s));
  CHECK(received() == 0);
  // Then datagrams are tried again.
  CHECK_FALSE(agent.exchange(node_heartbeat(0, 99), 50ms));
  CHECK(received() == 1);
  ::close(silent);
}
