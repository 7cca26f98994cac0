// Rails: a rank's several endpoints of one provider, one per NIC (TRN_FABRIC_RAILS), and how
// messages use them. Internal to collectives/fabric.
//
// Each rank has near rails, the NICs nearest its CPUs: those on its NUMA node (sysfs) when there
// are any, else all. Its own rail is the near rail its position among the ranks of its host (on
// that node) picks, round robin. The fabric's own control traffic (handshake, peer watch) stays
// on rail 0.
//
// A message to a peer on another host takes one of the sender's near rails, chosen by its tag
// (spread_rail): every message with one tag takes the same rail, so messages of one (peer, tag)
// stay in the provider's order, and consecutive values of any 16-bit field of the tag (a
// collective's steps, its sequence number, the count of a send/recv pair: collectives/tag.h) go
// round robin over the rails. So a chunked collective or a stream of pipeline sends spreads over
// every rail whatever its message size. The receiver, knowing every rank's near rails from
// connect, posts its receive on the same rail. A message to a peer on the same host that does not
// go through shm (TRN_FABRIC_SHM=0) takes the sender's own rail.
//
// A message of Options::stripe_min bytes or more to a peer on another host is striped: on the
// rail its tag picks goes a StripeHeader under the message's own tag (its first piece), marked by
// kStripeFlag in the remote CQ data, then one stripe per rail under wire::stripe(seq) (tag.h),
// stripe i being the i-th of stripe_range's equal, 64-byte aligned parts. The receiver's receive
// gets the header (it fits any buffer a striped message could fill), checks it, and only then
// posts the stripes' receives: it learns the length and the rails from the sender, so a receive
// posted for more bytes than were sent, or a sender that left a rail out, still matches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace trn::fabric {

inline constexpr uint64_t kStripeFlag = uint64_t{1} << 31;  // remote CQ data of a stripe header (32 bits: efa's)
inline constexpr uint32_t kStripeMagic = 0x74726e53;        // "trnS"

struct StripeHeader {
  uint32_t magic = kStripeMagic;
  uint32_t rails = 0;  // mask of the rails carrying a stripe, rail 0 = bit 0
  uint64_t len = 0;    // the message's bytes
  uint64_t seq = 0;    // its stripes' wire::stripe(seq)
};
static_assert(sizeof(StripeHeader) == 24);

// The mask of rails 0..n-1 (every rail of a rank with n).
inline constexpr uint32_t all_rails(size_t n) { return n >= 32 ? ~uint32_t{0} : (uint32_t{1} << n) - 1; }

// Bytes [first, second) of a len-byte message in stripe i of n: equal parts rounded up to 64
// bytes, so every stripe but the last starts 64-byte aligned in an aligned buffer; later parts
// may be empty for short messages.
inline std::pair<size_t, size_t> stripe_range(size_t len, int n, int i) {
  const size_t each = n > 0 ? ((len + size_t(n) - 1) / size_t(n) + 63) / 64 * 64 : len;
  const size_t first = std::min(len, each * size_t(i));
  return {first, std::min(len, first + each)};
}

// The near rails of a rank on NUMA node `numa` (-1: unknown), given the NUMA node of each rail
// (-1: unknown): the rails on its node when there are any, else every rail.
inline std::vector<int> near_rails(const std::vector<int>& rail_numa, int numa) {
  std::vector<int> near;
  for (int r = 0; r < static_cast<int>(rail_numa.size()); ++r)
    if (numa >= 0 && rail_numa[r] == numa) near.push_back(r);
  if (near.empty())
    for (int r = 0; r < static_cast<int>(rail_numa.size()); ++r) near.push_back(r);
  return near;
}

// The own rail of the position-th rank (0-based) of its host on NUMA node `numa`.
inline int choose_own_rail(int position, const std::vector<int>& rail_numa, int numa) {
  const std::vector<int> near = near_rails(rail_numa, numa);
  if (near.empty()) return 0;
  return near[static_cast<size_t>(position) % near.size()];
}

// The rail of `near` (a sender's near rails, not empty) that carries its messages with user tag
// `tag` to other hosts: the sum of the tag's 16-bit fields, mod the rails. A function of the tag
// alone, so that sender and receiver agree and one tag keeps to one rail; a sum, so that a step
// to the next value of any field moves to the next rail.
inline int spread_rail(uint64_t tag, const std::vector<int>& near) {
  const uint64_t fold = (tag & 0xffff) + (tag >> 16 & 0xffff) + (tag >> 32 & 0xffff) + (tag >> 48 & 0xffff);
  return near[fold % near.size()];
}

}  // namespace trn::fabric
