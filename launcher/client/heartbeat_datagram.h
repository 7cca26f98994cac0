// Node heartbeats as UDP datagrams: the wire format trnrun's agent and trn-coordinator share.
//
// A node heartbeat is small (about 70 bytes per rank it carries) and comes once a second from
// every node of every job. Over gRPC each one is an HTTP/2 exchange with its frames, timers and
// two sendmsg calls at least; at 100,000 ranks that per-call cost, on the coordinator and on the
// nodes, is what limits the coordinator. As a datagram it is one recvmmsg slot and one sendmmsg
// slot. gRPC stays the path for everything else, and the fallback for a heartbeat whose datagram
// gets no answer (CoordinatorClient::node_heartbeat).
//
//   offset  size  field
//   0       4     magic "TRNH"
//   4       1     version, 1
//   5       1     type: 1 request (payload: a serialized HeartbeatRequest), 2 reply (a
//                 serialized HeartbeatResponse)
//   6       1     mac: 0 none, 1 HMAC-SHA256 (32 bytes after the payload)
//   7       1     0
//   8       8     sequence, little-endian, never 0: the sender's, increasing from one request to
//                 the next; a reply carries its request's
//   16      8     epoch, little-endian: the coordinator's (JoinResponse.heartbeat_epoch), drawn
//                 anew each time it starts or a replica is elected leader
//   24      4     payload length n, little-endian
//   28      n     payload
//   28+n    32    with mac 1: HMAC-SHA256(key = the job's token, message = bytes 0 .. 28+n, and
//                 for a reply the request's 32 MAC bytes after them)
//
// Nothing follows: a datagram longer or shorter than its header says is refused.
//
// Authentication: a coordinator that requires tokens takes only datagrams MACed with the job's
// token (JoinResponse.job_token), and MACs its replies with it over the request's MAC too, so
// neither a heartbeat nor an abort can be forged by a host that lacks the token, and a reply
// answers only the request it was made for. The coordinator records a node's datagram only when
// its sequence is above that node's last in the generation (Registry::heartbeat; a gRPC heartbeat
// sent in place of an unanswered datagram raises it too), and only in its own epoch, so a captured
// datagram cannot be replayed to keep a dead node alive, not even to a coordinator restarted or
// newly elected. Without tokens nothing is authenticated (as gRPC without tokens), and a reply
// longer than its request is not sent, so the port cannot amplify a spoofed request. Heartbeats
// are not encrypted: they carry step, loss and throughput figures, no secrets.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace trn::control {

inline constexpr size_t kDatagramHeader = 28;
inline constexpr size_t kDatagramMac = 32;
// The largest datagram either side sends or reads. A node heartbeat larger than this (a node of
// several hundred ranks) goes over gRPC.
inline constexpr size_t kMaxDatagram = 60000;

enum class DatagramType : uint8_t { kRequest = 1, kReply = 2 };

// One datagram, as parsed: views into the bytes it was parsed from.
struct Datagram {
  DatagramType type = DatagramType::kRequest;
  uint64_t seq = 0, epoch = 0;
  std::string_view payload;
  std::string_view signed_bytes;  // header and payload: what the MAC covers (with `bound`)
  std::string_view mac;           // empty when the datagram carries none
};

// The datagram of type, seq, epoch and payload, MACed with key when key is not empty (over
// `bound` too: a reply passes its request's MAC); nullopt when it would exceed kMaxDatagram.
std::optional<std::string> encode_datagram(DatagramType type, uint64_t seq, uint64_t epoch,
                                           std::string_view payload, const std::string& key,
                                           std::string_view bound = {});

// Parses bytes; nullopt, with why set, when they are not a whole, well-formed datagram of this
// version. Checks no MAC (the key depends on the job the payload names): see datagram_mac_ok.
std::optional<Datagram> parse_datagram(std::string_view bytes, std::string* why);

// Whether d carries a MAC that key made (over `bound` too). An empty key accepts only a datagram
// without one.
bool datagram_mac_ok(const Datagram& d, const std::string& key, std::string_view bound = {});

// The MAC bytes at the end of a datagram encode_datagram made with a key ("" without one).
std::string_view mac_of(std::string_view datagram, bool keyed);

}  // namespace trn::control
