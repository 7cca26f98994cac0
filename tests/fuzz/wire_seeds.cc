// Writes the seeds of the wire fuzz targets (shm_ring, fabric_connect, fabric_notice,
// agent_heartbeat, agent_answer, heartbeat_datagram) with trn's own writers: a RingWriter's ring memory, the
// fabric's encoders, a worker's and an agent's datagrams. The checked-in seeds under
// tests/fuzz/corpus/ are its output:
//
//   cmake --build build/release --target trn_fuzz_wire_seeds
//   build/release/bin/trn_fuzz_wire_seeds tests/fuzz/corpus
#include <netinet/in.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/fabric/messages.h"
#include "collectives/fabric/shm_ring.h"
#include "launcher/client/agent_channel.h"
#include "launcher/client/heartbeat_datagram.h"
#include "trn/coordinator/v1/coordinator.pb.h"
#include "tests/fuzz/fuzz.h"

namespace {

using namespace trn;
using namespace trn::fabric;
namespace fs = std::filesystem;

fs::path root;

void seed(const std::string& target, const std::string& name, const std::vector<std::string>& parts) {
  std::string bytes;
  for (size_t i = 0; i < parts.size(); ++i) bytes += (i ? std::string(fuzz::kSeparator) : "") + parts[i];
  fs::create_directories(root / target);
  std::ofstream(root / target / name, std::ios::binary) << bytes;
  std::printf("%s/%s: %zu bytes\n", target.c_str(), name.c_str(), bytes.size());
}

template <typename T>
std::string raw(const T& v) {
  return std::string(reinterpret_cast<const char*>(&v), sizeof(v));
}

// A 4 KiB ring as tests/fuzz/shm_ring.cc reads it: head, tail, a later head, flags, the data.
struct Ring {
  alignas(kRingAlign) char mem[sizeof(RingControl) + 4096] = {};
  RingControl& ctl() { return *reinterpret_cast<RingControl*>(mem); }
  std::string image(uint64_t head, uint64_t later, bool pulls) {
    return raw(head) + raw(ctl().tail.load()) + raw(later) + std::string(1, pulls ? 1 : 0) +
           std::string(mem + sizeof(RingControl), 4096);
  }
};

// Round-trip script steps (tests/fuzz/shm_ring.cc).
std::string eager(uint64_t tag, uint16_t len, uint8_t shift, int split = -1) {
  std::string s(1, split < 0 ? 0 : 0x10);
  s += raw(tag) + raw(len) + std::string(1, static_cast<char>(shift));
  if (split >= 0) s += static_cast<char>(split);
  return s;
}
std::string record(uint8_t kind_op, uint64_t tag) {
  return std::string(1, static_cast<char>(kind_op)) + raw(tag);
}
std::string take(uint8_t n) { return std::string{7, static_cast<char>(n)}; }

// A user message's tag as a communicator makes them (collectives/tag.h): small numbers.
uint64_t wire_tag(uint64_t t) { return t | uint64_t{0x2a} << 40; }

void shm_ring() {
  // 64-byte aligned, so that a payload's place in its record (ring_payload_offset) is the same
  // in every build.
  alignas(kRingAlign) static char bytes[8192];
  for (size_t i = 0; i < sizeof(bytes); ++i) bytes[i] = static_cast<char>(i * 13 + 1);
  const std::string_view src(bytes, sizeof(bytes));
  {
    // Every kind, as the transport writes them; the last three after the head the reader sees first.
    Ring r;
    RingWriter w(r.mem, 4096);
    w.write(wire_tag(1), kRingEager, nullptr, 0);
    w.write(wire_tag(2), kRingEager, src.data(), 5);
    w.write(wire_tag(3), kRingEager, src.data() + 3, 1500);  // from 1 KiB on, at its source's alignment
    const uint64_t first = r.ctl().head.load();
    const RingLong l{1 << 20, 0};
    const RingPull p{1 << 21, 1, 0x7f0000001000};
    const RingAck a{0};
    w.write(wire_tag(4), kRingLong, &l, sizeof(l));
    w.write(wire_tag(5), kRingPull, &p, sizeof(p));
    w.write(0, kRingAck, &a, sizeof(a));
    const std::string script = eager(11, 0, 0) + eager(12, 100, 8) + eager(13, 2048, 40, 128) +
                               record(1, 14) + record(2, 15) + record(3, 16) + take(3) + eager(17, 1024, 63) +
                               take(7);
    seed("shm_ring", "every-kind", {r.image(first, r.ctl().head.load(), true), script});
  }
  {
    // A reader part way round: records up to the end, a pad, and one at the front.
    Ring r;
    RingWriter w(r.mem, 4096);
    RingReader rd(r.mem, 4096);
    for (int i = 0; i < 5; ++i) w.write(wire_tag(10 + i), kRingEager, src.data(), 700);
    RingReader::Record rec;
    for (int i = 0; i < 4; ++i) {
      rd.peek(&rec);
      rd.pop();
    }
    w.write(wire_tag(20), kRingEager, src.data(), 600);  // does not fit before the end: a pad first
    const uint64_t head = r.ctl().head.load();
    w.write(wire_tag(21), kRingEager, src.data(), 40);
    std::string script;
    for (int i = 0; i < 12; ++i)
      script += eager(100 + i, 1900, static_cast<uint8_t>(i * 5)) + (i % 3 == 2 ? take(2) : "");
    seed("shm_ring", "wrapped-with-pad", {r.image(head, r.ctl().head.load(), false), script});
  }
}

void fabric_connect() {
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_port = htons(40123);
  in.sin_addr.s_addr = htonl(0x0a000105);
  AddressRecord tcp;
  tcp.host = "node-a";
  tcp.host_id = "node-a/5b8e0c2e-8f0a-4f53-9d1c-0c6a2b7f1e11";
  tcp.provider = "tcp";
  tcp.main = raw(in);
  tcp.framing = "tcp;ofi_rxm 1.17";
  tcp.live = 40125;
  const RingOffer ring{"/trn-ring.4242.1a2b3c4d", 65536, 4242, 0x55d0c0ffee00, 0x9e3779b97f4a7c15};
  const int32_t rank = 3;
  seed("fabric_connect", "tcp-with-rings",
       {tcp.encode(), ring.encode(), encode_pull_report({0, 2, 5}), raw(rank)});
  const std::string shm_name = std::string("trn_4243_5f3e1_0") + '\0';
  AddressRecord shm = tcp;
  shm.shm = shm_name;
  shm.live = 0;
  shm.cpus = std::string("\x0c", 1);  // bound to cpus 2 and 3
  seed("fabric_connect", "shm-peer-no-pull",
       {shm.encode(), RingOffer{"/trn-ring.4243.00000001", 4 << 20, 4243, 0x1000, 1}.encode(),
        encode_pull_report({}), raw(rank)});
  sockaddr_in rail1 = in;
  rail1.sin_addr.s_addr = htonl(0x0a010105);
  AddressRecord rails = tcp;
  rails.rails = {raw(rail1)};
  rails.rail_numa = {0, -1};
  rails.numa = 0;
  rails.stripes = true;
  seed("fabric_connect", "two-rails", {rails.encode(), "", encode_pull_report({}), raw(rank)});
}

void fabric_notice() {
  seed("fabric_notice", "connect-refused",
       {encode_notice(5, "its process is gone: connecting to it failed (Connection refused)")});
  seed("fabric_notice", "ring-broken",
       {encode_notice(
           12,
           "it wrote a malformed record into its shared-memory ring: at 4096 (of a 65536-byte ring) "
           "a record of kind 1 claims 70000 bytes from offset 16, but 256 bytes are ready and "
           "61440 left before the ring's end")});
}

// HeartbeatTable script steps (tests/fuzz/agent_heartbeat.cc).
std::string expect(uint8_t generation, uint8_t first, uint8_t count) {
  return std::string{0, static_cast<char>(generation), static_cast<char>(first),
                     static_cast<char>(count - 1)};
}
std::string receive(uint8_t datagram, uint8_t from, uint8_t ms) {
  return std::string{1, static_cast<char>(datagram), static_cast<char>(from), static_cast<char>(ms)};
}
std::string take_beats(uint8_t ms) { return std::string{2, static_cast<char>(ms)}; }
std::string abort_all() { return std::string(1, 3); }
std::string resume(uint8_t pick, uint8_t generation, uint8_t node) {
  return std::string{4, static_cast<char>(pick), static_cast<char>(generation), static_cast<char>(node)};
}
std::string resend() { return std::string(1, 5); }

void agent() {
  using namespace trn::control;
  const std::string job = "fuzz-job";
  WorkerProgress a;
  a.rank = 2;
  a.host = "node-a";
  a.pid = 4242;
  a.step = 120;
  a.loss = 3.25;
  a.tokens_per_s = 81234.5;
  a.coordinates = GridCoordinates{1, 0, 0};
  a.val_loss = 3.5;
  WorkerProgress b = a;
  b.rank = 3;
  b.pid = 4243;
  b.coordinates = GridCoordinates{1, 1, 0};
  b.val_loss.reset();
  RecoveryReport rr;
  rr.recoveries = 1;
  rr.detect_to_generation_s = 0.8;
  rr.detect_to_restored_s = 1.5;
  rr.detect_to_first_step_s = 2.25;
  rr.restored_step = 100;
  rr.steps_lost = 20;
  rr.steps_lost_total = 20;
  rr.replaced = 1;
  rr.goodput = 0.93;
  b.recovery = rr;
  // The script: ranks 2..3 in generation 1, both heard, a node heartbeat, a failure, ranks resumed
  // in generation 2 (one heard there), resent, a node heartbeat, another job's datagram.
  const std::string script = expect(1, 2, 2) + receive(0, 0, 10) + receive(1, 1, 20) + receive(0, 0, 200) +
                             take_beats(5) + abort_all() + expect(2, 2, 2) + resume(0x0c, 2, 0) +
                             receive(2, 0, 30) + resend() + take_beats(50) + receive(3, 2, 1) + take_beats(1);
  seed("agent_heartbeat", "two-ranks-recover-in-place",
       {script, encode_worker_heartbeat(job, 1, a), encode_worker_heartbeat(job, 1, b),
        encode_worker_heartbeat(job, 2, a), encode_worker_heartbeat("another-job", 2, b)});
  seed("agent_answer", "abort", {encode_agent_abort("generation 4 ended: rank 3 (host node-b) failed", 5)});
  seed("agent_answer", "resume", {encode_agent_resume(Resume{5, 3, 8, 1})});
}

}  // namespace

// Node heartbeat datagrams for the job the heartbeat_datagram target forms (2 nodes x 4 ranks):
// node 0 with its ranks, node 1 with one of them and a recovery report, a worker heartbeat (which
// the coordinator refuses as a datagram), and a reply.
void heartbeat_datagrams() {
  using namespace trn::control;
  namespace v1 = ::trn::coordinator::v1;
  auto node = [](int node_rank, int ranks, bool recovery) {
    v1::HeartbeatRequest q;
    q.set_job_id("fuzz-job");
    q.set_generation(0);
    q.set_kind(v1::HeartbeatRequest::NODE);
    q.set_rank(node_rank);
    q.set_host("host-" + std::to_string(node_rank));
    for (int i = 0; i < ranks; ++i) {
      auto* e = q.add_ranks();
      e->set_rank(node_rank * 4 + i);
      e->set_pid(1000 + node_rank * 4 + i);
      e->set_step(7);
      e->set_loss(2.5);
      e->set_tokens_per_s(1234.5);
      e->mutable_coordinates()->set_dp_rank(node_rank * 4 + i);
      e->set_age_ms(10 * i);
      e->set_beats(1);
      if (recovery) {
        e->mutable_recovery()->set_recoveries(1);
        e->mutable_recovery()->set_goodput(0.9);
      }
    }
    return q.SerializeAsString();
  };
  auto request = [](uint64_t seq, const std::string& payload) {
    return *encode_datagram(DatagramType::kRequest, seq, 1, payload, "");
  };
  seed("heartbeat_datagram", "node-0", {request(1, node(0, 4, false))});
  seed("heartbeat_datagram", "two-nodes", {request(5, node(0, 4, false)), request(6, node(1, 1, true))});
  v1::HeartbeatRequest worker;
  worker.set_job_id("fuzz-job");
  worker.set_rank(2);
  worker.set_step(3);
  v1::HeartbeatResponse reply;
  reply.set_generation(0);
  reply.set_heartbeat_udp_port(29500);
  seed("heartbeat_datagram", "worker-and-reply",
       {request(9, worker.SerializeAsString()),
        *encode_datagram(DatagramType::kReply, 9, 1, reply.SerializeAsString(), "a key")});
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  root = argv[1];
  shm_ring();
  fabric_connect();
  fabric_notice();
  agent();
  heartbeat_datagrams();
  return 0;
}
