// The fabric's own messages between ranks, as bytes: what connect() exchanges through the store
// (each rank's address record, its ring segment, which peers' memory it reads), the handshake
// word, and the peer watch's loss notices (peer_watch.h). Internal to collectives/fabric.
//
// They come from other processes, so every decode checks what it reads and refuses anything
// else with one remote_error that says what is wrong; the caller adds whose it was. Each encode
// writes what its decode reads back unchanged. tests/fuzz/fabric_connect.cc and
// tests/fuzz/fabric_notice.cc fuzz them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trn::fabric {

// What each rank publishes under <prefix>/addr/<rank>: "key=value" lines, the fabric addresses
// in hex. A key this version does not know is skipped (a later one may add some); a value of a
// known key that does not parse is refused.
struct AddressRecord {
  std::string host, host_id, provider, main, shm, framing;
  int live = 0;  // port of the liveness socket (peer_watch.h), 0: none
  // The CPUs the rank may run on (its affinity mask; bit c % 8 of byte c / 8 is cpu c), at most
  // kMaxCpuBytes; empty: not known. connect() decides from the union of a host's masks whether
  // its ranks may spin (fit_to_host).
  std::string cpus;
  // The addresses of rails 1.. (rail 0 is main), at most kMaxRails in all; the NUMA node of each
  // rail's device, 0.. (rail 0 included; -1: unknown); the NUMA node of the rank's CPUs (-1: none
  // or several); whether its rails take striped messages (each carries remote CQ data).
  std::vector<std::string> rails;
  std::vector<int> rail_numa;
  int numa = -1;
  bool stripes = false;

  std::string encode() const;
  static AddressRecord decode(std::string_view s);
  bool operator==(const AddressRecord&) const = default;
};

inline constexpr size_t kMaxCpuBytes = 8192;  // 65536 CPUs
inline constexpr int kMaxRails = 32;  // a striped message's rail mask is 32 bits

// What a rank with a ring segment publishes under <prefix>/ring/<rank>:
// "<name> <capacity> <pid> <probe address> <probe>", the last two in hex (connect.cc). Refused:
// a name that is not a trn ring segment's ("/trn-ring.", no other '/'), a capacity that is not
// a power of two from 4 KiB to ring_capacity_for(kRingMaxEager), a pid that is not positive.
struct RingOffer {
  std::string name;
  size_t capacity = 0;
  int pid = 0;
  uint64_t probe_addr = 0, probe = 0;

  std::string encode() const;
  static RingOffer decode(std::string_view s);
  bool operator==(const RingOffer&) const = default;
};

// What a rank publishes under <prefix>/ring-mapped/<rank> once it mapped its peers' segments:
// "pull" and the ranks whose memory it reads, in increasing order. decode refuses a rank outside
// a world of size ranks, or one named twice.
std::string encode_pull_report(const std::vector<int>& ranks);
std::vector<int> decode_pull_report(std::string_view s, int size);

// The connect handshake: each rank sends its rank as an int32 to the next one round the world.
// What arrived (bytes of it) must be the expected rank's.
void check_handshake(const void* data, size_t bytes, int expected);

// A loss notice of the peer watch: "L<rank> <what happened>", at most kNoticeBytes (encode cuts
// the detail). decode refuses anything else, or a rank outside a world of size ranks; the detail
// it returns has every control character replaced by a space, so that errors naming it stay on
// one line.
inline constexpr size_t kNoticeBytes = 256;
struct Notice {
  int lost = -1;
  std::string detail;
};
std::string encode_notice(int lost, std::string_view detail);
Notice decode_notice(std::string_view msg, int size);

}  // namespace trn::fabric
