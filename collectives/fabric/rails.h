// Rails: a rank's several endpoints of one provider, one per NIC (TRN_FABRIC_RAILS), and how
// messages use them. Internal to collectives/fabric.
//
// Each rank has an own rail, the NIC nearest its CPUs: among the rails on its NUMA node (sysfs)
// when there are any, else among all, the one its position among the ranks of its host (on that
// node) picks, round robin. A message takes the sender's own rail; the receiver, knowing every
// rank's own rail from connect, posts its receive there. The fabric's own control traffic
// (handshake, peer watch) stays on rail 0.
//
// A message of Options::stripe_min bytes or more to a peer on another host is striped: on the
// sender's own rail goes a StripeHeader under the message's own tag (its first piece), marked by
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

// The own rail of the position-th rank (0-based) of its host on NUMA node `numa` (-1: unknown),
// given the NUMA node of each rail (-1: unknown).
inline int choose_own_rail(int position, const std::vector<int>& rail_numa, int numa) {
  std::vector<int> near;
  for (int r = 0; r < static_cast<int>(rail_numa.size()); ++r)
    if (numa >= 0 && rail_numa[r] == numa) near.push_back(r);
  if (near.empty())
    for (int r = 0; r < static_cast<int>(rail_numa.size()); ++r) near.push_back(r);
  if (near.empty()) return 0;
  return near[static_cast<size_t>(position) % near.size()];
}

}  // namespace trn::fabric
