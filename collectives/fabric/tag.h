// The 64-bit tag trn puts on the wire: the one place its layout is written down.
//
//   bit  63      control: 1 for the fabric's own traffic (the connect handshake, the peer watch's
//                probes and loss notices, the bytes of a long message announced in a
//                shared-memory ring: bit 55 set, bits 53..0 the sender's sequence number for that
//                peer, and the stripes of a message striped over rails: bit 54 set, bits 53..0
//                the sender's stripe sequence number for that peer); user messages never set it.
//   bits 62..56  piece: a message longer than the provider's max_msg_size (or the split size
//                forced by fabric::Options::max_piece) travels as pieces of that size, the last
//                one always shorter (0 bytes when the length is an exact multiple). Piece 0
//                carries 0; piece i >= 1 carries 1 + (i - 1) % 127, so a first piece never
//                matches a later one.
//   bits 55..0   user tag (trn::kUserTagMask): owned by the caller. Communicators split it as
//                collectives/tag.h describes (communicator id, operation, step).
//
// Pieces of one message go out in order and the receiver posts them one after another, so
// piece numbers that wrap (i and i + 127) cannot be confused on providers that keep
// send-after-send order (FI_ORDER_SAS, requested whenever the provider offers it).
#pragma once

#include <cstdint>

#include "collectives/p2p.h"

namespace trn::fabric::wire {

inline constexpr int kPieceShift = kUserTagBits;  // 56
inline constexpr uint64_t kPieceMask = uint64_t{0x7f} << kPieceShift;
inline constexpr uint64_t kControlBit = uint64_t{1} << 63;
inline constexpr uint32_t kPieceCycle = 127;

// The piece field of piece i of a message.
inline constexpr uint64_t piece_field(uint64_t i) {
  return i == 0 ? 0 : 1 + (i - 1) % kPieceCycle;
}

// The wire tag of piece i of a user message with tag user_tag.
inline constexpr uint64_t user(uint64_t user_tag, uint64_t piece) {
  return (user_tag & kUserTagMask) | piece_field(piece) << kPieceShift;
}

// The wire tag of the fabric's own control message kind (< 2^56).
inline constexpr uint64_t control(uint64_t kind) { return kControlBit | (kind & kUserTagMask); }

// Control message kinds: the ring handshake of connect, and the peer watch (probes and notices
// that a rank was lost, peer_watch.h).
inline constexpr uint64_t kHandshake = 1;
inline constexpr uint64_t kWatch = 2;

inline constexpr uint64_t user_part(uint64_t wire) { return wire & kUserTagMask; }

// The wire tag of the bytes of the seq-th long message a rank announced in its ring to one peer.
inline constexpr uint64_t kBulkBit = uint64_t{1} << 55;
inline constexpr uint64_t kStripeBit = uint64_t{1} << 54;
inline constexpr uint64_t kSeqMask = kStripeBit - 1;
inline constexpr uint64_t bulk(uint64_t seq) { return control(kBulkBit | (seq & kSeqMask)); }

// The wire tag of every stripe of the seq-th striped message a rank sent one peer (one stripe per
// rail, each on its own endpoint; rails.h).
inline constexpr uint64_t stripe(uint64_t seq) { return control(kStripeBit | (seq & kSeqMask)); }

static_assert(user(kUserTagMask, 0) == kUserTagMask);
static_assert(user(0, 1) == uint64_t{1} << 56);
static_assert(user(0, 127) == uint64_t{127} << 56);
static_assert(user(0, 128) == uint64_t{1} << 56);
static_assert((user(kUserTagMask, 300) & kControlBit) == 0);
static_assert(bulk(0) != control(1) && (bulk(~uint64_t{0}) & kPieceMask) == 0);
static_assert(stripe(0) != control(1) && stripe(0) != control(2) && (stripe(~uint64_t{0}) & kPieceMask) == 0);
static_assert((bulk(~uint64_t{0}) & kStripeBit) == 0 && (stripe(~uint64_t{0}) & kBulkBit) == 0);

}  // namespace trn::fabric::wire
