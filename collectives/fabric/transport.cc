#include "collectives/fabric/transport.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstring>

#include "collectives/core/log.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {
namespace {

constexpr uint64_t kSendWindow = 64;  // pieces of one split send in flight (< wire::kPieceCycle)
constexpr auto kExitCheck = std::chrono::milliseconds(10);  // how often a waiter looks for ended peers

class FabricRequest : public Request {
 public:
  FabricRequest(std::shared_ptr<Transport> t, std::shared_ptr<Op> op)
      : t_(std::move(t)), op_(std::move(op)) {}
  bool test() override { return t_->test(*op_); }
  void wait(Deadline deadline) override { t_->wait(*op_, deadline); }
  size_t bytes() const override { return op_->bytes; }

 private:
  std::shared_ptr<Transport> t_;
  std::shared_ptr<Op> op_;
};

std::shared_ptr<Op> new_op(bool send, int peer, uint64_t wire_tag, uint64_t msg_tag, char* buf, size_t len) {
  auto op = std::make_shared<Op>();
  op->send = send;
  op->peer = peer;
  op->wire_tag = wire_tag;
  op->msg_tag = msg_tag;
  op->buf = buf;
  op->len = len;
  return op;
}

}  // namespace

Transport::Transport(int rank, int size, const Options& opts, std::unique_ptr<Endpoint> main,
                     std::unique_ptr<Endpoint> shm, std::vector<Peer> peers, std::vector<RingSegment> segments,
                     Liveness liveness, std::vector<std::unique_ptr<Endpoint>> rails,
                     std::vector<std::string> rail_names)
    : rank_(rank), size_(size), opts_(opts), main_(std::move(main)), shm_(std::move(shm)),
      extra_rails_(std::move(rails)), rail_names_(std::move(rail_names)), peers_(std::move(peers)),
      segments_(std::move(segments)), liveness_(liveness) {
  rails_.push_back(main_.get());
  endpoints_ = {main_.get(), shm_.get()};
  stripe_ = !extra_rails_.empty() && main_->cq_data() && peers_[rank_].stripes;
  for (auto& r : extra_rails_) {
    rails_.push_back(r.get());
    endpoints_.push_back(r.get());
    stripe_ = stripe_ && r->cq_data();
  }
  fabric_ops_.assign(endpoints_.size(), 0);
  int local = 0;
  for (int q = 0; q < size_; ++q) {
    local += shm_ && q != rank_ && peers_[q].ep == shm_.get();
    if (peers_[q].ring) ring_peers_.push_back(q);
  }
  description_ = fmt::format("rank {}/{} {} on {}{}", rank_, size_, main_->provider(), main_->domain_name(),
                             main_->needs_mr() ? " (buffers registered)" : "");
  if (rails_.size() > 1) {
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
    description_ += fmt::format(", {} rails {} (own rail {}; messages to other hosts spread over {} by tag",
                                rails_.size(), names, rails_[peers_[rank_].own_rail]->domain_name(), near);
    description_ += stripe_ ? fmt::format(", those of {} bytes or more striped over all)", opts_.stripe_min)
                            : "; no striping: the provider carries no remote CQ data)";
  }
  if (shm_) description_ += fmt::format(" + shm to {} rank(s) on this host", local);
  if (!ring_peers_.empty())
    description_ += fmt::format(" + shared-memory rings to {} rank(s) (messages up to {} bytes inside)",
                                ring_peers_.size(), peers_[ring_peers_[0]].ring_eager);

  abort_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  can_sleep_ = abort_fd_ >= 0 && epoll_fd_ >= 0 && epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, abort_fd_, &ev) == 0;
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  can_sleep_ = can_sleep_ && wake_fd_ >= 0 && epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) == 0;
  for (Endpoint* ep : endpoints_) {
    if (ep && can_sleep_ && ep->wait_fd() >= 0 && epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, ep->wait_fd(), &ev) != 0)
      can_sleep_ = false;
  }
  log::debug(log::Subsys::kFabric, "{}; waits sleep on {}", description_,
             !can_sleep_ || main_->wait_fd() < 0 ? "short naps"
             : shm_ && shm_->wait_fd() < 0   ? "completion fds (naps while shm is busy)"
                                             : "completion fds");
  std::lock_guard lock(mu_);
  start_watch_locked();
}

Transport::~Transport() {
  {
    std::lock_guard lock(mu_);
    teardown_locked();
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (abort_fd_ >= 0) close(abort_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (liveness_.fd >= 0) close(liveness_.fd);
}

std::string Transport::peer_name(int peer) const {
  return fmt::format("rank {} (host {})", peer, peers_[peer].host);
}

RequestPtr Transport::isend(int peer, uint64_t tag, const void* buf, size_t len) {
  if (tag & ~kUserTagMask) throw usage_error("isend: tag {:#x} is wider than 56 bits", tag);
  return post(true, peer, wire::user(tag, 0), static_cast<char*>(const_cast<void*>(buf)), len);
}

RequestPtr Transport::irecv(int peer, uint64_t tag, void* buf, size_t len) {
  if (tag & ~kUserTagMask) throw usage_error("irecv: tag {:#x} is wider than 56 bits", tag);
  return post(false, peer, wire::user(tag, 0), static_cast<char*>(buf), len);
}

RequestPtr Transport::post_control(bool send, int peer, uint64_t wire_tag, void* buf, size_t len) {
  return post(send, peer, wire_tag, static_cast<char*>(buf), len);
}

RequestPtr Transport::post(bool send, int peer, uint64_t wire_tag, char* buf, size_t len) {
  if (peer < 0 || peer >= size_)
    throw usage_error("{}: peer {} is not a rank of this world (size {})", send ? "isend" : "irecv",
                      peer, size_);
  if (len > 0 && !buf) throw usage_error("{}: null buffer of {} bytes", send ? "isend" : "irecv", len);
  std::lock_guard lock(mu_);
  if (aborted()) throw aborted_error_now();
  if (lost_ >= 0) throw remote_error("rank {}: {}", rank_, lost_text_);
  if (!rail_lost_.empty()) throw remote_error("rank {}: {}", rank_, rail_lost_);
  Peer& p = peers_[peer];
  if (send && !p.exited.empty()) throw remote_error("{}", p.exited);

  auto op = new_op(send, peer, wire_tag, wire_tag, buf, len);
  if (!p.ring && stripes_to(peer, *op) && send) {
    post_striped_send_locked(op);
  } else if (!p.ring) {
    start_fabric_locked(op, true);
  } else {
    active_.emplace(op.get(), op);
    if (send) post_ring_send_locked(op);
    else post_ring_recv_locked(op);
  }
  return std::make_shared<FabricRequest>(shared_from_this(), op);
}

bool Transport::stripes_to(int peer, const Op& op) const {
  const Peer& p = peers_[peer];
  return stripe_ && p.stripes && !p.rail_addr.empty() && !(op.wire_tag & wire::kControlBit) &&
         op.len >= opts_.stripe_min && p.host_index != peers_[rank_].host_index;
}

void Transport::route_locked(Op& op) const {
  if (op.ep) return;
  const Peer& p = peers_[op.peer];
  if (p.rail_addr.empty() || (op.wire_tag & wire::kControlBit)) {
    op.ep = p.ep;
    op.addr = p.addr;
    return;
  }
  const int r = rail_of(op);
  op.ep = rails_[r];
  op.addr = p.rail_addr[r];
}

int Transport::rail_of(const Op& op) const {
  const Peer& sender = peers_[op.send ? rank_ : op.peer];
  if (peers_[op.peer].host_index == peers_[rank_].host_index || sender.near_rails.empty()) return sender.own_rail;
  return spread_rail(wire::user_part(op.msg_tag), sender.near_rails);
}

int Transport::endpoint_index(const Op& op) const {
  for (size_t i = 0; i < endpoints_.size(); ++i)
    if (endpoints_[i] == op.ep) return static_cast<int>(i);
  return 0;
}

void Transport::start_part_locked(const std::shared_ptr<Op>& parent, bool send, Endpoint* ep, fi_addr_t addr,
                                  uint64_t wire_tag, char* buf, size_t len, uint64_t cq_data) {
  auto part = new_op(send, parent->peer, wire_tag, parent->msg_tag, buf, len);
  if (buf == parent->header.data()) {
    // The header's bytes live in the part: the provider may hold them after the parent is gone.
    part->header = parent->header;
    part->buf = part->header.data();
  }
  part->ep = ep;
  part->addr = addr;
  part->cq_data = cq_data;
  part->parent = parent;
  ++parent->parts;
  start_fabric_locked(part, false);
}

void Transport::post_striped_send_locked(const std::shared_ptr<Op>& op) {
  Peer& p = peers_[op->peer];
  const int head = rail_of(*op);  // where the receiver posted its receive
  op->striped = true;
  op->ep = rails_[head];  // what a timeout names
  op->addr = p.rail_addr[head];
  active_.emplace(op.get(), op);
  const int n = static_cast<int>(rails_.size());
  StripeHeader h;
  h.rails = all_rails(rails_.size());
  h.len = op->len;
  h.seq = p.next_stripe++;
  std::memcpy(op->header.data(), &h, sizeof(h));
  // The header first, on the rail of the message's tag under that tag, then a stripe per rail.
  // A part that fails at once fails op; the rest still go (their buffers stay valid until op's
  // request is let go, and the peer may be waiting for them).
  ++op->parts;  // held until every part is started, so none completes op early
  start_part_locked(op, true, rails_[head], p.rail_addr[head], op->wire_tag, op->header.data(), sizeof(h),
                    kStripeFlag);
  for (int r = 0; r < n && !op->part_error; ++r) {
    const auto [first, end] = stripe_range(op->len, n, r);
    if (end > first)
      start_part_locked(op, true, rails_[r], p.rail_addr[r], wire::stripe(h.seq), op->buf + first, end - first, 0);
  }
  --op->parts;
  settle_parent_locked(*op);
}

void Transport::on_stripe_header_locked(const std::shared_ptr<Op>& op, size_t got) {
  Peer& p = peers_[op->peer];
  StripeHeader h;
  const int n = static_cast<int>(rails_.size());
  const uint32_t all = all_rails(rails_.size());
  if (got == sizeof(h)) std::memcpy(&h, op->buf, sizeof(h));
  if (got != sizeof(h) || h.magic != kStripeMagic || h.rails == 0 || (h.rails & ~all) || p.rail_addr.empty()) {
    suspect_peer_locked(op->peer, fmt::format("it sent a malformed stripe header ({} bytes) with tag {:#x}", got,
                                              wire::user_part(op->msg_tag)));
    finish(*op, remote_error("{} sent a malformed stripe header with tag {:#x}", peer_name(op->peer),
                             wire::user_part(op->msg_tag)));
    return;
  }
  if (h.len > op->len) {
    finish(*op, remote_error("a message from {} with tag {:#x} is longer than the {}-byte receive buffer",
                             peer_name(op->peer), wire::user_part(op->msg_tag), op->len));
    return;
  }
  // No more pieces of its own: the stripes carry the bytes.
  op->max_pieces = op->posted;
  forget_split_locked(*op);
  op->striped = true;
  op->striped_len = h.len;
  op->bytes = 0;
  std::vector<int> used;
  for (int r = 0; r < n; ++r)
    if (h.rails >> r & 1) used.push_back(r);
  ++op->parts;
  for (size_t i = 0; i < used.size() && !op->part_error; ++i) {
    const auto [first, end] = stripe_range(h.len, static_cast<int>(used.size()), static_cast<int>(i));
    const int r = used[i];
    if (end > first)
      start_part_locked(op, false, rails_[r], p.rail_addr[r], wire::stripe(h.seq), op->buf + first, end - first, 0);
  }
  --op->parts;
  settle_parent_locked(*op);
}

// A part of a striped message is done (completed or failed): its parent learns of it. The
// parent completes only once every part is done, so that no part still touches the caller's
// buffer when the caller hears of it; a part that failed fails the parent then, and makes the
// peer a suspect at once, since the peer may wait for a stripe that will never come.
void Transport::part_done_locked(Op& part) {
  std::shared_ptr<Op> parent = std::move(part.parent);
  if (!parent) return;
  --parent->parts;
  std::optional<Error> failed = part.error;
  if (!failed && !part.send && part.bytes != part.len)
    failed = remote_error("a stripe of a message from {} with tag {:#x} had {} bytes, not {}", peer_name(parent->peer),
                          wire::user_part(parent->msg_tag), part.bytes, part.len);
  if (failed && !parent->part_error) {
    parent->part_error = failed;
    if (parent->role == Op::Role::kUser && !parent->done && lost_ < 0 && rail_lost_.empty() && !aborted())
      suspect_peer_locked(parent->peer, fmt::format("a stripe of a {} it failed: {}",
                                                    parent->send ? "send to" : "receive from", failed->what()));
  }
  settle_parent_locked(*parent);
}

void Transport::settle_parent_locked(Op& parent) {
  if (parent.parts > 0 || parent.done) return;
  if (!parent.part_error) parent.bytes = parent.send ? parent.len : parent.striped_len;
  finish(parent, parent.part_error);
}

void Transport::forget_split_locked(Op& op) {
  if (!op.may_split) return;
  auto it = split_order_.find(Key{op.send, op.peer, op.wire_tag, op.ep});
  if (it != split_order_.end()) {
    it->second.remove(&op);
    if (it->second.empty()) split_order_.erase(it);
  }
  op.may_split = false;
}

void Transport::start_fabric_locked(const std::shared_ptr<Op>& op, bool retry) {
  route_locked(*op);
  size_t limit = op->ep->max_msg_size();
  if (opts_.max_piece) limit = std::min(limit, opts_.max_piece);
  op->piece_size = limit;
  op->max_pieces = op->len / limit + 1;
  op->may_split = op->len >= limit;
  op->contexts.resize(op->send ? std::min<uint64_t>(op->max_pieces, kSendWindow) : 1);
  if (op->ep->needs_mr() && op->len > 0) {
    try {
      op->mr = op->ep->mr().acquire(op->buf, op->len);
    } catch (const Error& e) {
      if (!active_.count(op.get()) && !op->parent) throw;  // posting: the caller gets it
      finish(*op, e);  // a part: its parent learns of it
      return;
    }
  }
  if (op->may_split) split_order_[Key{op->send, op->peer, op->wire_tag, op->ep}].push_back(op.get());
  active_.emplace(op.get(), op);
  op->on_fabric = true;
  ++fabric_ops_[endpoint_index(*op)];

  auto& q = queued_[{op->send, op->peer}];
  bool posted_first = false;
  if (q.empty()) {
    posted_first = post_pieces_locked(*op);
    if (!posted_first && retry) {  // -FI_EAGAIN: let the provider make room, then try once more
      progress_locked();
      posted_first = op->done || post_pieces_locked(*op);
    }
  }
  if (!posted_first) {
    q.push_back(op);
    ++queued_count_;
  } else if (!op->done && op->may_split && op->posted < op->max_pieces) {
    continuing_.push_back(op);
  }
}

void Transport::post_ring_send_locked(const std::shared_ptr<Op>& op) {
  Peer& p = peers_[op->peer];
  if (op->len <= p.ring_eager) {
    op->ring_eager = true;
  } else if (p.pull_out) {
    op->pull = true;
    op->wire_tag = wire::bulk(p.next_bulk++);  // only the sequence number matters: the ack echoes it
  } else {
    op->wire_tag = wire::bulk(p.next_bulk++);  // the record carries the sequence number
    op->unannounced = true;
    start_fabric_locked(op, true);
  }
  p.ring_sends.push_back(op);
  flush_ring_locked(p);
}

void Transport::flush_ring_locked(Peer& p) {
  while (!p.acks.empty()) {
    const RingAck ack{p.acks.front().first};
    if (!p.out.write(0, kRingAck, &ack, sizeof(ack))) return;
    if (Op* op = p.acks.front().second.get(); op && !op->done) finish(*op, std::nullopt);
    p.acks.pop_front();
  }
  while (!p.ring_sends.empty()) {
    Op& op = *p.ring_sends.front();
    if (!op.done) {
      bool written;
      const uint64_t seq = op.wire_tag & wire::kSeqMask;
      if (op.ring_eager) {
        written = p.out.write(op.msg_tag, kRingEager, op.buf, op.len);
      } else if (op.pull) {
        const RingPull rec{op.len, seq, reinterpret_cast<uintptr_t>(op.buf)};
        written = p.out.write(op.msg_tag, kRingPull, &rec, sizeof(rec));
      } else {
        const RingLong rec{op.len, seq};
        written = p.out.write(op.msg_tag, kRingLong, &rec, sizeof(rec));
      }
      if (!written) return;  // full: the peer has not taken earlier records yet
      if (op.ring_eager) {
        op.bytes = op.len;
        finish(op, std::nullopt);
      } else if (op.pull) {
        p.pulled.emplace(seq, p.ring_sends.front());  // complete when the peer acknowledges
      } else {
        op.unannounced = false;  // its bytes may have gone already (an inject completes at once)
        if (op.posted == op.max_pieces && op.inflight == 0) finish(op, std::nullopt);
      }
    }
    p.ring_sends.pop_front();  // a failed op's record is not needed any more
  }
}

void Transport::post_ring_recv_locked(const std::shared_ptr<Op>& op) {
  Peer& p = peers_[op->peer];
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    if (it->tag != op->wire_tag) continue;
    Unexpected u = std::move(*it);
    p.unexpected.erase(it);
    deliver_locked(op, u.kind, u.data.data(), u.data.size());
    return;
  }
  p.ring_recvs.push_back(op);
  drain_ring_locked(p);
}

// Records are taken in arrival order while some receive from this peer is posted or some pulled
// send waits for its ack: one that matches no receive waits in p.unexpected (its bytes copied
// out) so those behind it can match. Otherwise they stay in the ring, and the sender waits when
// it is full. A peer that ended is drained to the end (what it wrote before still arrives), then
// everything still pending with it fails.
void Transport::drain_ring_locked(Peer& p) {
  RingReader::Record r;
  for (;;) {
    while (!p.ring_recvs.empty() && p.ring_recvs.front()->done) p.ring_recvs.pop_front();  // failed meanwhile
    if (p.ring_recvs.empty() && p.pulled.empty() && p.exited.empty()) break;
    try {
      if (!p.in.peek(&r)) break;
    } catch (const Error& e) {  // it broke its ring (shm_ring.h)
      lose_peer_locked(static_cast<int>(&p - peers_.data()), e.what());
      break;
    }
    if (r.kind == kRingAck) {
      on_ack_locked(p, r.data, r.len);
      p.in.pop();
      continue;
    }
    auto it = std::find_if(p.ring_recvs.begin(), p.ring_recvs.end(),
                           [&](const std::shared_ptr<Op>& o) { return !o->done && o->wire_tag == r.tag; });
    if (it != p.ring_recvs.end()) {
      std::shared_ptr<Op> op = std::move(*it);
      p.ring_recvs.erase(it);
      deliver_locked(op, r.kind, r.data, r.len);
    } else {
      p.unexpected.push_back({r.tag, r.kind, std::vector<char>(r.data, r.data + r.len)});
    }
    p.in.pop();
  }
  if (!p.exited.empty()) {
    const int peer = static_cast<int>(&p - peers_.data());
    for (auto& [seq, op] : p.acks)  // pulled in full: only the ack to the ended peer is left
      if (op && !op->done) finish(*op, std::nullopt);
    p.acks.clear();
    // What the caller still waits for with it never comes: the peer is lost. Nothing pending
    // with it is a peer that finished and exited.
    if (user_ops_with(peer)) lose_peer_locked(peer, p.exited);
    p.ring_recvs.clear();
    p.ring_sends.clear();
    p.pulled.clear();
  }
}

void Transport::on_ack_locked(Peer& p, const char* data, size_t len) {
  RingAck ack;
  try {
    ack = decode_ring_payload(kRingAck, data, len, p.pull_in).ack;
  } catch (const Error& e) {
    lose_peer_locked(static_cast<int>(&p - peers_.data()), e.what());
    return;
  }
  auto it = p.pulled.find(ack.seq);
  if (it == p.pulled.end()) return;  // the send failed meanwhile
  std::shared_ptr<Op> op = std::move(it->second);
  p.pulled.erase(it);
  op->bytes = op->len;
  finish(*op, std::nullopt);
}

// Copies a long message's bytes out of the sender's memory, then acks; the receive completes once
// the ack is written. A message longer than the receive fails the receive only (as a truncation
// does on libfabric); the sender is acknowledged either way, except when its process is gone.
void Transport::pull_locked(const std::shared_ptr<Op>& op, const RingPull& rec) {
  Peer& p = peers_[op->peer];
  if (!p.exited.empty()) {  // its pid may name another process by now
    finish(*op, remote_error("{} (receiving {} bytes from it)", p.exited, rec.length));
    return;
  }
  if (rec.length > op->len) {
    finish(*op, remote_error("a message from {} with tag {:#x} is {} bytes, longer than the {}-byte receive buffer",
                             peer_name(op->peer), wire::user_part(op->msg_tag), rec.length, op->len));
  } else {
    size_t done = 0;
    while (done < rec.length) {
      iovec local{op->buf + done, rec.length - done};
      iovec remote{reinterpret_cast<void*>(rec.addr + done), rec.length - done};
      const ssize_t got = process_vm_readv(p.pid, &local, 1, &remote, 1, 0);
      if (got > 0) {
        done += static_cast<size_t>(got);
        continue;
      }
      const int err = got < 0 ? errno : EFAULT;
      if (err == EINTR) continue;
      if (err == EFAULT && p.in.writer_closed()) break;  // an aborted sender freed the buffer: below
      // A sender killed mid-message: ESRCH, or EFAULT while its memory is being torn down.
      if (err == ESRCH || (err == EFAULT && ending(p))) {  // nobody waits for the ack
        lose_peer_locked(op->peer, fmt::format("{} (receiving {} bytes from it)", exit_text(op->peer), rec.length));
        next_exit_check_ = {};  // the next progress marks it exited
        return;
      }
      finish(*op, remote_error("receiving {} bytes from {}: reading them from its memory failed after {} bytes: {}",
                               rec.length, peer_name(op->peer), done, std::strerror(err)));
      break;
    }
    // The sender closes its side of the ring when it aborts, before its buffers may be reused:
    // a pull that ends before the close is seen read bytes the send still owned.
    if (!op->done && p.in.writer_closed())
      finish(*op, remote_error("{} aborted before its {}-byte message to rank {} was read", peer_name(op->peer),
                               rec.length, rank_));
    if (!op->done) op->bytes = rec.length;
  }
  p.acks.emplace_back(rec.seq, op->done ? nullptr : op);
  flush_ring_locked(p);
}

void Transport::deliver_locked(const std::shared_ptr<Op>& op, uint32_t kind, const char* data, size_t len) {
  RingPayload m;
  try {
    m = decode_ring_payload(kind, data, len, peers_[op->peer].pull_in);
  } catch (const Error& e) {
    lose_peer_locked(op->peer, e.what());
    return;
  }
  if (m.kind == kRingAck) {  // never: drain_ring_locked takes acks before they meet a receive
    lose_peer_locked(op->peer, "it wrote an ack into its shared-memory ring where a message belongs");
    return;
  }
  if (m.kind == kRingEager) {
    if (len > op->len) {
      finish(*op, remote_error("a message from {} with tag {:#x} is {} bytes, longer than the {}-byte receive "
                               "buffer", peer_name(op->peer), wire::user_part(op->msg_tag), len, op->len));
      return;
    }
    if (len) std::memcpy(op->buf, data, len);
    op->bytes = len;
    finish(*op, std::nullopt);
    return;
  }
  if (m.kind == kRingPull) {
    pull_locked(op, m.pull);
    return;
  }
  op->wire_tag = wire::bulk(m.long_msg.seq);
  start_fabric_locked(op, false);  // a longer message than op->len fails as a truncation
}

bool Transport::can_post(const Op& op) const {
  if (op.done || op.posted >= op.max_pieces) return false;
  if (op.posted > 0) {
    if (op.send ? op.inflight >= kSendWindow : op.inflight > 0) return false;
    auto it = split_order_.find(Key{op.send, op.peer, op.wire_tag, op.ep});
    if (it != split_order_.end() && it->second.front() != &op) return false;  // an earlier split op
  }
  return true;
}

// Posts as many pieces as the op may have in flight. False only on -FI_EAGAIN before the first
// piece went out; other errors fail the op.
bool Transport::post_pieces_locked(Op& op) {
  Endpoint* ep = op.ep;
  void* desc = op.mr ? MrCache::desc(*op.mr) : nullptr;
  while (can_post(op)) {
    const uint64_t i = op.posted;
    const size_t off = i * op.piece_size;
    const size_t plen = std::min(op.piece_size, op.len - off);
    PieceContext& c = op.contexts[i % op.contexts.size()];
    c.op = &op;
    c.index = i;
    c.len = plen;
    const uint64_t tag = op.wire_tag | wire::piece_field(i) << wire::kPieceShift;
    ssize_t rc = op.send ? ep->tsend(op.buf + off, plen, desc, op.addr, tag, &c, i == 0 ? op.cq_data : 0)
                         : ep->trecv(op.buf + off, plen, desc, op.addr, tag, &c);
    if (rc == -FI_EAGAIN) return i > 0;
    if (rc != 0) {
      finish(op, remote_error("{} {} {} bytes failed: {}", op.send ? "posting send to" : "posting receive from",
                              peer_name(op.peer), plen, fi_strerror(static_cast<int>(-rc))));
      return true;
    }
    ++op.posted;
    ++op.inflight;
  }
  return true;
}

void Transport::drain_queues_locked() {
  if (queued_count_) {
    for (auto& [key, q] : queued_) {
      while (!q.empty()) {
        std::shared_ptr<Op> op = q.front();
        if (!op->done && !post_pieces_locked(*op)) break;  // -FI_EAGAIN: keep order, retry later
        q.pop_front();
        --queued_count_;
        if (!op->done && op->may_split && op->posted < op->max_pieces) continuing_.push_back(op);
      }
    }
  }
  for (auto it = continuing_.begin(); it != continuing_.end();) {
    Op& op = **it;
    if (op.done || op.posted >= op.max_pieces) {
      it = continuing_.erase(it);
      continue;
    }
    post_pieces_locked(op);
    ++it;
  }
}

void Transport::progress() {
  std::lock_guard lock(mu_);
  if (aborted()) throw aborted_error_now();
  progress_locked();
}

void Transport::progress_locked() {
  if (aborted()) return;
  progress_now_locked();
}

void Transport::progress_now_locked() {
  check_exits_locked();
  for (int peer : ring_peers_) {
    Peer& p = peers_[peer];
    if (!p.ring_sends.empty() || !p.acks.empty()) flush_ring_locked(p);
    if (!p.ring_recvs.empty() || !p.pulled.empty()) drain_ring_locked(p);
  }
  constexpr size_t kBatch = 16;
  fi_cq_tagged_entry entries[kBatch];
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    Endpoint* ep = endpoints_[i];
    if (!ep || fabric_ops_[i] == 0) continue;  // nothing of ours in its queue
    for (;;) {
      ssize_t n = ep->read(entries, kBatch);
      if (n > 0) {
        for (ssize_t i = 0; i < n; ++i) on_complete(*static_cast<PieceContext*>(entries[i].op_context), entries[i]);
        if (static_cast<size_t>(n) < kBatch) break;
      } else if (n == -FI_EAVAIL) {
        on_error(*ep);
      } else {
        if (n != -FI_EAGAIN)
          log::warn(log::Subsys::kFabric, "{} fi_cq_read: {}", ep->provider(), fi_strerror(static_cast<int>(-n)));
        break;
      }
    }
  }
  drain_queues_locked();
  watch_locked();
  if (followers_ > 0 && completions_ != announced_) {
    announced_ = completions_;
    woken_.notify_all();
  }
  if (fd_sleeper_ && completions_ != fd_announced_ && wake_fd_ >= 0) {
    fd_announced_ = completions_;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
}

void Transport::on_complete(PieceContext& c, const fi_cq_tagged_entry& e) {
  std::shared_ptr<Op> keep = active_.at(c.op);
  Op& op = *keep;
  const size_t got = e.len;
  --op.inflight;
  if (!op.done && !op.send && c.index == 0 && (e.flags & FI_REMOTE_CQ_DATA) && (e.data & kStripeFlag) &&
      op.role == Op::Role::kUser) {
    on_stripe_header_locked(keep, got);  // the first piece was a striped message's header
  } else if (!op.done) {
    op.bytes += got;
    if (op.send) {
      if (op.posted == op.max_pieces && op.inflight == 0 && !op.unannounced) finish(op, std::nullopt);
    } else if (got < op.piece_size || c.index + 1 >= op.max_pieces) {
      finish(op, std::nullopt);  // a short piece ends the message (tag.h)
      if (op.role == Op::Role::kWatch) heard_.push_back(op.peer);  // read after the queues (watch_locked)
    }
  }
  if (op.done && op.inflight == 0) finish(op, op.error);
}

void Transport::on_error(Endpoint& ep) {
  fi_cq_err_entry err;
  std::string text;
  if (!ep.read_error(&err, &text)) return;
  auto* c = static_cast<PieceContext*>(err.op_context);
  if (!c || !active_.count(c->op)) {
    log::warn(log::Subsys::kFabric, "{}: error completion without an operation: {}", ep.provider(), text);
    return;
  }
  std::shared_ptr<Op> keep = active_.at(c->op);
  Op& op = *keep;
  --op.inflight;
  if (!op.done && op.role != Op::Role::kUser) {
    // The watch's own standing receive or notice only ends: a peer that finished may close its
    // connection.
    finish(op, remote_error("{}", text));
  } else if (!op.done) {
    if (err.err == FI_ETRUNC && !op.send) {
      finish(op, remote_error("a message from {} with tag {:#x} is longer than the {}-byte receive buffer",
                              peer_name(op.peer), wire::user_part(op.msg_tag), op.len));
    } else if (err.err == FI_ECANCELED) {
      // trn never cancels: the provider gave up on this peer (tcp: its connection closed).
      suspect_peer_locked(op.peer, fmt::format("a {} it failed: the provider cancelled it, the connection to "
                                               "the peer was lost (did it exit or die?)",
                                               op.send ? "send to" : "receive from"));
    } else {
      suspect_peer_locked(op.peer, fmt::format("a {} it failed: {}", op.send ? "send to" : "receive from", text));
    }
  }
  if (op.done && op.inflight == 0) finish(op, op.error);
}

// Marks op done (once) and, when the provider holds none of its pieces any more, lets it go.
void Transport::finish(Op& op, std::optional<Error> error) {
  if (!op.done) {
    op.done = true;
    ++completions_;
    op.error = std::move(error);
    forget_split_locked(op);
    part_done_locked(op);
  }
  if (op.inflight > 0) return;
  if (op.mr) {
    op.ep->mr().release(*op.mr);
    op.mr.reset();
  }
  // finish() may run more than once for an op (done, then its last piece back): count it once.
  // Erasing may destroy op, so nothing reads it afterwards.
  const int ep = op.on_fabric ? endpoint_index(op) : -1;
  if (active_.erase(&op) && ep >= 0) --fabric_ops_[ep];
}

void Transport::check_exits_locked() {
  const auto now = Clock::now();
  if (now < next_exit_check_) return;
  next_exit_check_ = now + kExitCheck;
  // A ring peer that lost a rank says so in its ring's closed word.
  for (int peer : ring_peers_) {
    const int lost = ring_lost_rank(peers_[peer].in.closed_code(), size_);
    if (lost_ < 0 && lost >= 0) lose_peer_locked(lost, "it told this rank through shared memory", peer);
  }
  pollfd fds[64];
  int who[64];
  nfds_t n = 0;
  for (int peer : ring_peers_) {
    const Peer& p = peers_[peer];
    if (p.pidfd < 0 || !p.exited.empty()) continue;
    fds[n] = {p.pidfd, POLLIN, 0};
    who[n] = peer;
    if (++n == std::size(fds)) break;  // more same-host peers than this: the rest at their deadline
  }
  if (n == 0 || poll(fds, n, 0) <= 0) return;
  for (nfds_t i = 0; i < n; ++i)
    if (fds[i].revents & (POLLIN | POLLHUP)) peer_exited_locked(who[i]);
}

std::string Transport::exit_text(int peer) const {
  return fmt::format("{} ended: its process (pid {}) on this host exited or was killed", peer_name(peer),
                     peers_[peer].pid);
}

bool Transport::ending(const Peer& p) {
  if (p.pidfd < 0) return false;
  pollfd fd{p.pidfd, POLLIN, 0};
  return poll(&fd, 1, 100) > 0;  // an exiting process signals its pidfd once its memory is gone
}

void Transport::peer_exited_locked(int peer) {
  Peer& p = peers_[peer];
  p.exited = exit_text(peer);
  log::error(log::Subsys::kFabric, "rank {}: {}", rank_, p.exited);
  drain_ring_locked(p);
}

void Transport::teardown_locked() {
  flush_notices_locked();
  Error e = aborted() ? aborted_error_now() : aborted_error("the fabric endpoint was closed");
  for (auto& [p, op] : active_) {
    if (!op->done) {
      op->done = true;
      op->error = e;
    }
    op->mr.reset();  // the cache closes with its endpoint
  }
  active_.clear();
  watch_.clear();
  notices_.clear();
  queued_.clear();
  queued_count_ = 0;
  continuing_.clear();
  split_order_.clear();
  for (auto& p : peers_) {
    if (p.ring) p.out.close();  // peers must not pull from this rank's buffers any more
    p.ep = nullptr;
    p.ring = false;
    p.ring_sends.clear();
    p.ring_recvs.clear();
    p.unexpected.clear();
    p.acks.clear();
    p.pulled.clear();
    if (p.pidfd >= 0) close(p.pidfd);
    p.pidfd = -1;
    if (p.live_fd >= 0) close(p.live_fd);
    p.live_fd = -1;
    for (auto& rp : p.rail_probes)
      if (rp.fd >= 0) close(std::exchange(rp.fd, -1));
  }
  ring_peers_.clear();
  segments_.clear();
  std::fill(fabric_ops_.begin(), fabric_ops_.end(), 0);
  endpoints_.clear();
  rails_.clear();
  extra_rails_.clear();
  shm_.reset();
  main_.reset();
}

uint64_t Transport::registrations() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (Endpoint* ep : endpoints_)
    if (ep && ep->needs_mr()) n += ep->mr().registrations();
  return n;
}

}  // namespace trn::fabric
