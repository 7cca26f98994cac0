// Fuzz target: node heartbeat datagrams (launcher/client/heartbeat_datagram.h), what any host
// that reaches the coordinator's UDP port can send, and the coordinator's handling of them
// (CoordinatorService::heartbeat_datagram on a registry holding one running job of 2 nodes x 4
// ranks, with tokens required). An input's parts (fuzz.h): up to eight datagrams.
//
// For each part:
//  - parse_datagram either refuses it or takes it apart so that encode_datagram, given the same
//    type, sequence, epoch and payload (and the job's token when the part's MAC is the token's),
//    makes the same bytes again;
//  - the part as it came gets no answer: it cannot carry the job token's MAC;
//  - the part's payload, signed with the job's token under the next sequence number in the
//    coordinator's epoch, gets either no answer (the registry refused it) or a reply datagram with
//    that sequence whose MAC covers the request's and whose payload is a HeartbeatResponse; the
//    same bytes again are never recorded twice: any answer to them is an abort (an old
//    generation, an unknown or stopped job), which changes nothing.
#include "launcher/client/heartbeat_datagram.h"

#include <google/protobuf/stubs/logging.h>

#include "launcher/server/metrics.h"
#include "launcher/server/registry.h"
#include "launcher/server/service.h"
#include "tests/fuzz/fuzz.h"

namespace {

using namespace trn;
using namespace trn::control;
namespace v1 = ::trn::coordinator::v1;

constexpr const char* kJob = "fuzz-job";

struct World {
  Clock::time_point now = Clock::time_point() + std::chrono::hours(1);
  RpcMetrics metrics;
  std::unique_ptr<Registry> registry;
  std::unique_ptr<CoordinatorService> service;
  std::string token;  // the job's

  World() {
    RegistryOptions o;
    o.now = [this] { return now; };
    o.unix_ms = [] { return int64_t{1'800'000'000'000}; };
    o.job_token_key = "the coordinator's admin token";
    registry = std::make_unique<Registry>(o);
    for (int node = 0; node < 2; ++node) {
      v1::JoinRequest q;
      q.set_job_id(kJob);
      q.set_node_id("node-" + std::to_string(node));
      q.set_host("host-" + std::to_string(node));
      q.set_nproc_per_node(4);
      q.set_min_nodes(2);
      q.set_max_nodes(2);
      q.set_timeout_ms(1000);
      registry->join(q, [this](const Status& s, v1::JoinResponse r) {
        fuzz::require(s.ok(), "the job's join failed: " + s.message);
        token = r.job_token();
      });
    }
    fuzz::require(!token.empty(), "the job formed without a token");
    service = std::make_unique<CoordinatorService>(*registry, metrics, o.job_token_key);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  World w;
  uint64_t seq = 1;
  for (const std::string_view part : fuzz::split(data, size, 8)) {
    if (auto d = parse_datagram(part, nullptr)) {
      fuzz::require(d->seq != 0, "parsed a datagram with sequence 0");
      std::string key;
      if (!d->mac.empty()) {
        fuzz::require(!datagram_mac_ok(*d, ""), "a MAC accepted with no key");
        if (datagram_mac_ok(*d, w.token)) key = w.token;
      }
      if (d->mac.empty() || !key.empty()) {
        auto again = encode_datagram(d->type, d->seq, d->epoch, d->payload, key);
        fuzz::require(again && *again == part, "a parsed datagram does not encode to the same bytes");
      }
    }
    fuzz::require(
        !w.service->heartbeat_datagram(part) || parse_datagram(part, nullptr)->mac.size() == kDatagramMac,
        "a datagram without the job token's MAC got an answer");

    std::string_view payload = part;
    if (auto d = parse_datagram(part, nullptr)) payload = d->payload;
    seq += 1 + (part.empty() ? 0 : static_cast<unsigned char>(part[0]) % 3);
    auto signed_bytes =
        encode_datagram(DatagramType::kRequest, seq, w.service->datagram_epoch(), payload, w.token);
    if (!signed_bytes) continue;  // too large to send
    const std::string_view request_mac = mac_of(*signed_bytes, true);
    auto check_answer = [&](const std::string& answer) {
      auto r = parse_datagram(answer, nullptr);
      fuzz::require(r && r->type == DatagramType::kReply && r->seq == seq,
                    "an answer that is not the reply to it");
      fuzz::require(datagram_mac_ok(*r, w.token, request_mac),
                    "an answer without the job token's MAC over its request");
      v1::HeartbeatResponse resp;
      fuzz::require(resp.ParseFromArray(r->payload.data(), static_cast<int>(r->payload.size())),
                    "an answer whose payload is not a HeartbeatResponse");
      return resp;
    };
    if (auto answer = w.service->heartbeat_datagram(*signed_bytes)) check_answer(*answer);
    if (auto again = w.service->heartbeat_datagram(*signed_bytes))
      fuzz::require(check_answer(*again).abort(), "a replayed datagram was recorded again");
    w.now += std::chrono::milliseconds(100);
  }
  return 0;
}
