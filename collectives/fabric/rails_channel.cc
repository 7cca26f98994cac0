#include "collectives/fabric/rails_channel.h"

#include <cstring>

#include "collectives/fabric/rails.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {

RailsChannel::RailsChannel(Hub& hub, FabricChannel& fabric, const Options& opts, int rank,
                           std::vector<RailPeer> peers, std::vector<int> host_index)
    : hub_(hub), fabric_(fabric), stripe_min_(opts.stripe_min), rank_(rank), peers_(std::move(peers)),
      host_(std::move(host_index)), rails_(fabric.rails()) {
  stripe_ = rails_.size() > 1 && peers_[rank_].stripes;
  for (Endpoint* r : rails_) stripe_ = stripe_ && r->cq_data();
}

std::string RailsChannel::describe() const {
  if (rails_.size() <= 1) return "";
  std::string names;
  for (size_t r = 0; r < rails_.size(); ++r) {
    if (r) names += '+';
    names += rails_[r]->domain_name();
  }
  std::string near;
  for (int r : peers_[rank_].near_rails) {
    if (!near.empty()) near += '+';
    near += rails_[r]->domain_name();
  }
  std::string s = fmt::format(", {} rails {} (own rail {}; messages to other hosts spread over {} by tag",
                              rails_.size(), names, rails_[peers_[rank_].own_rail]->domain_name(), near);
  s += stripe_ ? fmt::format(", those of {} bytes or more striped over all)", stripe_min_)
               : "; no striping: the provider carries no remote CQ data)";
  return s;
}

bool RailsChannel::stripes(const Op& op) const {
  const RailPeer& p = peers_[op.peer];
  return stripe_ && p.stripes && !p.addr.empty() && !(op.wire_tag & wire::kControlBit) && op.len >= stripe_min_ &&
         host_[op.peer] != host_[rank_];
}

void RailsChannel::route(Op& op) const {
  const RailPeer& p = peers_[op.peer];
  if (op.fab.ep || p.addr.empty() || (op.wire_tag & wire::kControlBit)) return;
  const int r = rail_of(op);
  op.fab.ep = rails_[r];
  op.fab.addr = p.addr[r];
}

int RailsChannel::rail_of(const Op& op) const {
  const RailPeer& sender = peers_[op.send ? rank_ : op.peer];
  if (host_[op.peer] == host_[rank_] || sender.near_rails.empty()) return sender.own_rail;
  return spread_rail(wire::user_part(op.msg_tag), sender.near_rails);
}

void RailsChannel::start_part(const std::shared_ptr<Op>& parent, bool send, int rail, uint64_t wire_tag, char* buf,
                              size_t len, uint64_t cq_data) {
  auto part = new_op(send, parent->peer, wire_tag, parent->msg_tag, buf, len);
  if (buf == parent->stripe.header.data()) {
    // The header's bytes live in the part: the provider may hold them after the parent is gone.
    part->stripe.header = parent->stripe.header;
    part->buf = part->stripe.header.data();
  }
  part->fab.ep = rails_[rail];
  part->fab.addr = peers_[parent->peer].addr[rail];
  part->fab.cq_data = cq_data;
  part->stripe.parent = parent;
  ++parent->stripe.parts;
  fabric_.start(part, false);
}

void RailsChannel::send_striped(const std::shared_ptr<Op>& op) {
  RailPeer& p = peers_[op->peer];
  const int head = rail_of(*op);  // where the receiver posted its receive
  op->stripe.striped = true;
  op->fab.ep = rails_[head];  // what a timeout names
  op->fab.addr = p.addr[head];
  hub_.track(op);
  const int n = static_cast<int>(rails_.size());
  StripeHeader h;
  h.rails = all_rails(rails_.size());
  h.len = op->len;
  h.seq = p.next_stripe++;
  std::memcpy(op->stripe.header.data(), &h, sizeof(h));
  // The header first, on the rail of the message's tag under that tag, then a stripe per rail.
  // A part that fails at once fails op; the rest still go (their buffers stay valid until op's
  // request is let go, and the peer may be waiting for them).
  ++op->stripe.parts;  // held until every part is started, so none completes op early
  start_part(op, true, head, op->wire_tag, op->stripe.header.data(), sizeof(h), kStripeFlag);
  for (int r = 0; r < n && !op->stripe.part_error; ++r) {
    const auto [first, end] = stripe_range(op->len, n, r);
    if (end > first) start_part(op, true, r, wire::stripe(h.seq), op->buf + first, end - first, 0);
  }
  --op->stripe.parts;
  settle(*op);
}

void RailsChannel::on_header(const std::shared_ptr<Op>& op, size_t got) {
  const RailPeer& p = peers_[op->peer];
  StripeHeader h;
  const int n = static_cast<int>(rails_.size());
  const uint32_t all = all_rails(rails_.size());
  const uint64_t tag = wire::user_part(op->msg_tag);
  if (got == sizeof(h)) std::memcpy(&h, op->buf, sizeof(h));
  if (got != sizeof(h) || h.magic != kStripeMagic || h.rails == 0 || (h.rails & ~all) || p.addr.empty()) {
    hub_.suspect(op->peer, fmt::format("it sent a malformed stripe header ({} bytes) with tag {:#x}", got, tag));
    hub_.finish(*op, remote_error("{} sent a malformed stripe header with tag {:#x}", hub_.peer_name(op->peer), tag));
    return;
  }
  if (h.len > op->len) {
    hub_.finish(*op, remote_error("a message from {} with tag {:#x} is longer than the {}-byte receive buffer",
                                  hub_.peer_name(op->peer), tag, op->len));
    return;
  }
  fabric_.stop_pieces(*op);  // no more pieces of its own: the stripes carry the bytes
  op->stripe.striped = true;
  op->stripe.striped_len = h.len;
  op->bytes = 0;
  std::vector<int> used;
  for (int r = 0; r < n; ++r)
    if (h.rails >> r & 1) used.push_back(r);
  ++op->stripe.parts;
  for (size_t i = 0; i < used.size() && !op->stripe.part_error; ++i) {
    const auto [first, end] = stripe_range(h.len, static_cast<int>(used.size()), static_cast<int>(i));
    if (end > first) start_part(op, false, used[i], wire::stripe(h.seq), op->buf + first, end - first, 0);
  }
  --op->stripe.parts;
  settle(*op);
}

// The parent completes only once every part is done, so that no part still touches the caller's
// buffer when the caller hears of it; a part that failed fails the parent then, and makes the
// peer a suspect at once, since the peer may wait for a stripe that will never come.
void RailsChannel::part_done(Op& part) {
  std::shared_ptr<Op> parent = std::move(part.stripe.parent);
  if (!parent) return;
  --parent->stripe.parts;
  std::optional<Error> failed = part.error;
  if (!failed && !part.send && part.bytes != part.len)
    failed = remote_error("a stripe of a message from {} with tag {:#x} had {} bytes, not {}",
                          hub_.peer_name(parent->peer), wire::user_part(parent->msg_tag), part.bytes, part.len);
  if (failed && !parent->stripe.part_error) {
    parent->stripe.part_error = failed;
    if (parent->role == Op::Role::kUser && !parent->done && !hub_.failing())
      hub_.suspect(parent->peer, fmt::format("a stripe of a {} it failed: {}",
                                             parent->send ? "send to" : "receive from", failed->what()));
  }
  settle(*parent);
}

void RailsChannel::settle(Op& parent) {
  if (parent.stripe.parts > 0 || parent.done) return;
  if (!parent.stripe.part_error) parent.bytes = parent.send ? parent.len : parent.stripe.striped_len;
  hub_.finish(parent, parent.stripe.part_error);
}

}  // namespace trn::fabric
