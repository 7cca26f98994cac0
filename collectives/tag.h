// The layout of the 56-bit point-to-point tag (PointToPoint::kUserTagBits) used by communicators.
//
//   bits 55..40  communicator id (16 bits). The world communicator is 0; split() picks the
//                smallest id that no member of the new group uses yet, so two communicators that
//                share a pair of processes never share an id.
//   bits 39..16  operation (24 bits). Collectives: bit 39 clear, bits 38..16 the collective's
//                sequence number on this communicator (every member issues collectives in the
//                same order, so they agree). Point-to-point send/recv: bit 39 set, bits 38..16
//                the count of earlier messages between the same two ranks in that direction.
//   bits 15..0   step (16 bits): which message of the operation this is between the two ranks,
//                numbered by the algorithm (e.g. ring step * chunks + chunk). kCheckStep is kept
//                for the TRN_CHECK_COLLECTIVES descriptor exchange.
//
// Sequence numbers and steps wrap; that is safe because a wrapped value can only collide with a
// message 2^23 operations (or 2^16 messages of one operation) earlier, long since matched.
#pragma once

#include <cstdint>

namespace trn::tag {

inline constexpr int kStepBits = 16;
inline constexpr int kOpBits = 24;
inline constexpr int kCommBits = 16;
inline constexpr uint64_t kStepMask = (uint64_t{1} << kStepBits) - 1;
inline constexpr uint64_t kOpMask = (uint64_t{1} << kOpBits) - 1;
inline constexpr uint64_t kCommMask = (uint64_t{1} << kCommBits) - 1;
inline constexpr uint64_t kP2POpBit = uint64_t{1} << (kOpBits - 1);
inline constexpr uint32_t kMaxCommIds = 1u << kCommBits;
inline constexpr uint64_t kCheckStep = kStepMask;

// Tag of a collective's message: op is the collective sequence number.
inline uint64_t collective(uint32_t comm, uint64_t seq, uint64_t step) {
  return (uint64_t{comm} & kCommMask) << (kStepBits + kOpBits) |
         (seq & (kOpMask >> 1)) << kStepBits | (step & kStepMask);
}

// Tag of the n-th send/recv message between two ranks in one direction.
inline uint64_t p2p(uint32_t comm, uint64_t n) {
  return (uint64_t{comm} & kCommMask) << (kStepBits + kOpBits) |
         (kP2POpBit | (n & (kOpMask >> 1))) << kStepBits;
}

inline uint32_t comm_of(uint64_t tag) {
  return static_cast<uint32_t>((tag >> (kStepBits + kOpBits)) & kCommMask);
}

}  // namespace trn::tag
