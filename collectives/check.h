// TRN_CHECK_COLLECTIVES: before a collective runs, every member sends its call descriptor to
// every other member; any difference fails the operation on every rank with a usage error that
// names the ranks and what each called.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/dtype.h"

namespace trn {
namespace algo {
class Context;
}

enum class OpKind : uint8_t {
  kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kBarrier, kAllToAll, kSplit, kAgreeCostModel,
  kAllReduceE4M3, kReduceScatterE4M3, kAllToAllV
};

const char* to_string(OpKind k);

struct CallDesc {
  OpKind op = OpKind::kBarrier;
  DataType dtype = DataType::kU8;
  ReduceOp redop = ReduceOp::kSum;
  int32_t root = -1;
  uint64_t count = 0;  // all_to_all_v: 0 (its counts differ by rank)
  bool operator==(const CallDesc&) const = default;
  // "all_reduce(count=10, f32, sum)", "broadcast(count=4, u8, root=1)", "barrier()",
  // "all_to_all_v(f32)".
  std::string describe() const;
};

// Exchanges descriptors with every member (tag step kCheckStep); throws on any mismatch.
void check_same_call(algo::Context& c, uint32_t comm_id, uint64_t seq, const CallDesc& mine);

// all_to_all_v under the checks: every rank tells each peer how many bytes it will send it, and
// every rank learns each one's first disagreement with its recv_counts, so a mismatch fails the
// operation on every rank with one usage error naming both ranks and both counts (elements of es
// bytes). Tag steps kCheckStep - 1 and - 2, apart from the exchange's own.
void check_all_to_all_v_counts(algo::Context& c, const std::vector<size_t>& send_bytes,
                               const std::vector<size_t>& recv_bytes, size_t es);

}  // namespace trn
