// One operation of the transport (a send or a receive of one message) and what the channels ask
// of the transport that owns them. Internal to collectives/fabric.
//
// An Op has a common part (who, what tag, which bytes, done or failed) and one slice per channel:
// the libfabric channel's pieces and registration (fabric_channel.h), the ring's record kind
// (ring_channel.h), the rails' striping (rails_channel.h). A channel reads and writes its own
// slice and the common part only.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/fabric/endpoint.h"

namespace trn::fabric {

struct Op;

// The context libfabric hands back with each completion: one per posted piece.
struct PieceContext {
  fi_context2 ctx;  // first: providers with FI_CONTEXT/FI_CONTEXT2 mode use it as scratch
  Op* op = nullptr;
  uint64_t index = 0;
  size_t len = 0;
};

// The libfabric channel's slice: the pieces a message travels as (tag.h), its registration, and
// the endpoint and peer address its pieces go through (rails.h: which rail).
struct FabricSlice {
  size_t piece_size = 0;
  uint64_t max_pieces = 0;  // send: exactly this many; receive: at most
  uint64_t posted = 0, inflight = 0;
  bool may_split = false;  // pieces after the first wait for earlier split ops on the same key
  bool on_fabric = false;  // handed to a libfabric endpoint (counted in its busy count)
  std::optional<MrCache::Handle> mr;
  std::vector<PieceContext> contexts;  // ring, indexed by piece % size
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  uint64_t cq_data = 0;  // a send's remote CQ data (a stripe header's kStripeFlag)
};

// The shm ring's slice: how a send to a ring peer travels.
struct RingSlice {
  bool eager = false;  // its bytes travel in the peer's ring
  bool pull = false;   // a long send the peer reads from buf (kRingPull)
};

// The rails' slice. A striped message's op is a parent: its parts (the header, the stripes) are
// ops of their own that name it; it completes when the last of them did, and fails with the
// first that failed. A receive becomes a parent when its first piece was a header.
struct StripeSlice {
  std::shared_ptr<Op> parent;
  int parts = 0;                    // parts not yet done
  std::optional<Error> part_error;  // the first part's failure
  bool striped = false;             // a parent
  size_t striped_len = 0;           // a striped receive: the bytes the header announced
  std::array<char, 24> header{};    // a striped send's StripeHeader
};

struct Op {
  // What the op is for: the caller's, or the peer watch's own (peer_watch.h): a standing receive
  // for loss notices, a notice. A lost peer fails only the caller's.
  enum class Role : uint8_t { kUser, kWatch, kNotice };
  Role role = Role::kUser;
  bool send = false;
  bool held = false;  // a send whose pieces may all be out, that still waits for its channel (ring)
  bool done = false;
  int peer = 0;
  uint64_t wire_tag = 0;  // piece field clear; wire::bulk(seq) for the bytes of a long ring message
  uint64_t msg_tag = 0;   // the message's own wire tag (what errors name)
  char* buf = nullptr;
  size_t len = 0;
  size_t bytes = 0;
  uint64_t seen_tick = 0;  // the peer watch's probe tick that first saw it pending (0: none yet)
  std::optional<Error> error;
  FabricSlice fab;
  RingSlice ring;
  StripeSlice stripe;
};

inline std::shared_ptr<Op> new_op(bool send, int peer, uint64_t wire_tag, uint64_t msg_tag, char* buf, size_t len) {
  auto op = std::make_shared<Op>();
  op->send = send;
  op->peer = peer;
  op->wire_tag = wire_tag;
  op->msg_tag = msg_tag;
  op->buf = buf;
  op->len = len;
  return op;
}

// What the channels and the peer watch ask of the router that owns them (router.h). Every call
// is made with the transport's lock held.
class Hub {
 public:
  // Marks op done (once) and, once no channel holds it any more, lets it go.
  virtual void finish(Op& op, std::optional<Error> error) = 0;
  // The operations in flight: the router keeps each until it is let go.
  virtual void track(const std::shared_ptr<Op>& op) = 0;
  virtual bool tracked(const Op& op) const = 0;
  virtual std::shared_ptr<Op> keep(Op* op) const = 0;  // a tracked op (a completion's)
  virtual std::vector<std::shared_ptr<Op>> user_ops() const = 0;  // the caller's, not done
  virtual bool user_ops_with(int peer) const = 0;
  // The peer watch's interface (peer_watch.h), for every channel.
  virtual void suspect(int peer, const std::string& detail) = 0;
  virtual void lose(int peer, const std::string& detail, int reporter = -1) = 0;
  virtual bool failing() const = 0;  // a peer or a rail was lost, or the transport aborted
  // The libfabric channel hands over what its completions mean to others.
  virtual void stripe_header(const std::shared_ptr<Op>& op, size_t got) = 0;
  virtual void heard(int peer) = 0;  // the peer watch's standing receive from peer completed
  // The peer watch's own messages, on the libfabric channel; nullptr when it cannot post.
  virtual std::shared_ptr<Op> post_internal(Op::Role role, int peer, char* buf, size_t len) = 0;
  virtual void progress() = 0;      // once, unless aborted
  virtual void progress_now() = 0;  // also while aborting (teardown)
  virtual std::string peer_name(int peer) const = 0;

 protected:
  ~Hub() = default;
};

}  // namespace trn::fabric
