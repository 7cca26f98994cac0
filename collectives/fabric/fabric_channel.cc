#include "collectives/fabric/fabric_channel.h"

#include <algorithm>

#include "collectives/core/log.h"
#include "collectives/fabric/rails.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {
namespace {

constexpr uint64_t kSendWindow = 64;  // pieces of one split send in flight (< wire::kPieceCycle)

}  // namespace

FabricChannel::FabricChannel(Hub& hub, const Options& opts, std::unique_ptr<Endpoint> main,
                             std::unique_ptr<Endpoint> shm, std::vector<std::unique_ptr<Endpoint>> rails,
                             std::vector<Route> routes)
    : hub_(hub), max_piece_(opts.max_piece), main_(std::move(main)), shm_(std::move(shm)),
      extra_rails_(std::move(rails)), routes_(std::move(routes)) {
  endpoints_ = {main_.get(), shm_.get()};
  for (auto& r : extra_rails_) endpoints_.push_back(r.get());
  busy_.assign(endpoints_.size(), 0);
}

std::vector<Endpoint*> FabricChannel::rails() const {
  std::vector<Endpoint*> r;
  if (!main_) return r;
  r.push_back(main_.get());
  for (auto& e : extra_rails_) r.push_back(e.get());
  return r;
}

int FabricChannel::endpoint_index(const Op& op) const {
  for (size_t i = 0; i < endpoints_.size(); ++i)
    if (endpoints_[i] == op.fab.ep) return static_cast<int>(i);
  return 0;
}

void FabricChannel::forget_split(Op& op) {
  if (!op.fab.may_split) return;
  auto it = split_order_.find(Key{op.send, op.peer, op.wire_tag, op.fab.ep});
  if (it != split_order_.end()) {
    it->second.remove(&op);
    if (it->second.empty()) split_order_.erase(it);
  }
  op.fab.may_split = false;
}

void FabricChannel::stop_pieces(Op& op) {
  op.fab.max_pieces = op.fab.posted;
  forget_split(op);
}

void FabricChannel::start(const std::shared_ptr<Op>& op, bool retry) {
  FabricSlice& f = op->fab;
  if (!f.ep) {
    f.ep = routes_[op->peer].ep;
    f.addr = routes_[op->peer].addr;
  }
  size_t limit = f.ep->max_msg_size();
  if (max_piece_) limit = std::min(limit, max_piece_);
  f.piece_size = limit;
  f.max_pieces = op->len / limit + 1;
  f.may_split = op->len >= limit;
  f.contexts.resize(op->send ? std::min<uint64_t>(f.max_pieces, kSendWindow) : 1);
  if (f.ep->needs_mr() && op->len > 0) {
    try {
      f.mr = f.ep->mr().acquire(op->buf, op->len);
    } catch (const Error& e) {
      if (!hub_.tracked(*op) && !op->stripe.parent) throw;  // posting: the caller gets it
      hub_.finish(*op, e);  // a part: its parent learns of it
      return;
    }
  }
  if (f.may_split) split_order_[Key{op->send, op->peer, op->wire_tag, f.ep}].push_back(op.get());
  hub_.track(op);
  f.on_fabric = true;
  ++busy_[endpoint_index(*op)];

  auto& q = queued_[{op->send, op->peer}];
  bool posted_first = false;
  if (q.empty()) {
    posted_first = post_pieces(*op);
    if (!posted_first && retry) {  // -FI_EAGAIN: let the provider make room, then try once more
      hub_.progress();
      posted_first = op->done || post_pieces(*op);
    }
  }
  if (!posted_first) {
    q.push_back(op);
    ++queued_count_;
  } else if (!op->done && f.may_split && f.posted < f.max_pieces) {
    continuing_.push_back(op);
  }
}

bool FabricChannel::can_post(const Op& op) const {
  const FabricSlice& f = op.fab;
  if (op.done || f.posted >= f.max_pieces) return false;
  if (f.posted > 0) {
    if (op.send ? f.inflight >= kSendWindow : f.inflight > 0) return false;
    auto it = split_order_.find(Key{op.send, op.peer, op.wire_tag, f.ep});
    if (it != split_order_.end() && it->second.front() != &op) return false;  // an earlier split op
  }
  return true;
}

// Posts as many pieces as the op may have in flight. False only on -FI_EAGAIN before the first
// piece went out; other errors fail the op.
bool FabricChannel::post_pieces(Op& op) {
  FabricSlice& f = op.fab;
  Endpoint* ep = f.ep;
  void* desc = f.mr ? MrCache::desc(*f.mr) : nullptr;
  while (can_post(op)) {
    const uint64_t i = f.posted;
    const size_t off = i * f.piece_size;
    const size_t plen = std::min(f.piece_size, op.len - off);
    PieceContext& c = f.contexts[i % f.contexts.size()];
    c.op = &op;
    c.index = i;
    c.len = plen;
    const uint64_t tag = op.wire_tag | wire::piece_field(i) << wire::kPieceShift;
    ssize_t rc = op.send ? ep->tsend(op.buf + off, plen, desc, f.addr, tag, &c, i == 0 ? f.cq_data : 0)
                         : ep->trecv(op.buf + off, plen, desc, f.addr, tag, &c);
    if (rc == -FI_EAGAIN) return i > 0;
    if (rc != 0) {
      hub_.finish(op, remote_error("{} {} {} bytes failed: {}", op.send ? "posting send to" : "posting receive from",
                                   hub_.peer_name(op.peer), plen, fi_strerror(static_cast<int>(-rc))));
      return true;
    }
    ++f.posted;
    ++f.inflight;
  }
  return true;
}

void FabricChannel::drain_queues() {
  if (queued_count_) {
    for (auto& [key, q] : queued_) {
      while (!q.empty()) {
        std::shared_ptr<Op> op = q.front();
        if (!op->done && !post_pieces(*op)) break;  // -FI_EAGAIN: keep order, retry later
        q.pop_front();
        --queued_count_;
        if (!op->done && op->fab.may_split && op->fab.posted < op->fab.max_pieces) continuing_.push_back(op);
      }
    }
  }
  for (auto it = continuing_.begin(); it != continuing_.end();) {
    Op& op = **it;
    if (op.done || op.fab.posted >= op.fab.max_pieces) {
      it = continuing_.erase(it);
      continue;
    }
    post_pieces(op);
    ++it;
  }
}

void FabricChannel::progress() {
  for (size_t i = 0; i < endpoints_.size(); ++i)
    if (endpoints_[i] && busy_[i] != 0) read(*endpoints_[i]);  // idle: nothing of ours in its queue
  drain_queues();
}

void FabricChannel::read(Endpoint& ep) {
  constexpr size_t kBatch = 16;
  fi_cq_tagged_entry entries[kBatch];
  for (;;) {
    ssize_t n = ep.read(entries, kBatch);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) on_complete(*static_cast<PieceContext*>(entries[i].op_context), entries[i]);
      if (static_cast<size_t>(n) < kBatch) break;
    } else if (n == -FI_EAVAIL) {
      on_error(ep);
    } else {
      if (n != -FI_EAGAIN)
        log::warn(log::Subsys::kFabric, "{} fi_cq_read: {}", ep.provider(), fi_strerror(static_cast<int>(-n)));
      break;
    }
  }
}

void FabricChannel::on_complete(PieceContext& c, const fi_cq_tagged_entry& e) {
  std::shared_ptr<Op> keep = hub_.keep(c.op);
  Op& op = *keep;
  const size_t got = e.len;
  --op.fab.inflight;
  if (!op.done && !op.send && c.index == 0 && (e.flags & FI_REMOTE_CQ_DATA) && (e.data & kStripeFlag) &&
      op.role == Op::Role::kUser) {
    hub_.stripe_header(keep, got);  // the first piece was a striped message's header
  } else if (!op.done) {
    op.bytes += got;
    if (op.send) {
      if (sent_all(op) && !op.held) hub_.finish(op, std::nullopt);
    } else if (got < op.fab.piece_size || c.index + 1 >= op.fab.max_pieces) {
      hub_.finish(op, std::nullopt);  // a short piece ends the message (tag.h)
      if (op.role == Op::Role::kWatch) hub_.heard(op.peer);
    }
  }
  if (op.done && op.fab.inflight == 0) hub_.finish(op, op.error);
}

void FabricChannel::on_error(Endpoint& ep) {
  fi_cq_err_entry err;
  std::string text;
  if (!ep.read_error(&err, &text)) return;
  auto* c = static_cast<PieceContext*>(err.op_context);
  if (!c || !hub_.keep(c->op)) {
    log::warn(log::Subsys::kFabric, "{}: error completion without an operation: {}", ep.provider(), text);
    return;
  }
  std::shared_ptr<Op> keep = hub_.keep(c->op);
  Op& op = *keep;
  --op.fab.inflight;
  const char* what = op.send ? "send to" : "receive from";
  if (!op.done && op.role != Op::Role::kUser) {
    // The watch's own standing receive or notice only ends: a peer that finished may close its
    // connection.
    hub_.finish(op, remote_error("{}", text));
  } else if (!op.done) {
    if (err.err == FI_ETRUNC && !op.send) {
      hub_.finish(op, remote_error("a message from {} with tag {:#x} is longer than the {}-byte receive buffer",
                                   hub_.peer_name(op.peer), wire::user_part(op.msg_tag), op.len));
    } else if (err.err == FI_ECANCELED) {
      // trn never cancels: the provider gave up on this peer (tcp: its connection closed).
      hub_.suspect(op.peer, fmt::format("a {} it failed: the provider cancelled it, the connection to the peer was "
                                        "lost (did it exit or die?)", what));
    } else {
      hub_.suspect(op.peer, fmt::format("a {} it failed: {}", what, text));
    }
  }
  if (op.done && op.fab.inflight == 0) hub_.finish(op, op.error);
}

void FabricChannel::let_go(Op& op, bool counted) {
  if (op.fab.mr) {
    op.fab.ep->mr().release(*op.fab.mr);
    op.fab.mr.reset();
  }
  if (counted && op.fab.on_fabric) --busy_[endpoint_index(op)];
}

uint64_t FabricChannel::registrations() const {
  uint64_t n = 0;
  for (Endpoint* ep : endpoints_)
    if (ep && ep->needs_mr()) n += ep->mr().registrations();
  return n;
}

void FabricChannel::close() {
  queued_.clear();
  queued_count_ = 0;
  continuing_.clear();
  split_order_.clear();
  for (auto& r : routes_) r.ep = nullptr;
  std::fill(busy_.begin(), busy_.end(), 0);
  endpoints_.clear();
  extra_rails_.clear();
  shm_.reset();
  main_.reset();
}

}  // namespace trn::fabric
