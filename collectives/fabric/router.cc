#include "collectives/fabric/router.h"

#include "collectives/core/log.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {
namespace {

// Each channel's part of every peer, taken out of what connect found.
template <typename Part>
std::vector<Part> parts(std::vector<Peer>& peers, Part Peer::*part) {
  std::vector<Part> out;
  out.reserve(peers.size());
  for (Peer& p : peers) out.push_back(std::move(p.*part));
  return out;
}

std::vector<FabricChannel::Route> routes(const std::vector<Peer>& peers) {
  std::vector<FabricChannel::Route> out;
  for (const Peer& p : peers) out.push_back({p.ep, p.addr});
  return out;
}

std::vector<WatchPeer> watch_parts(std::vector<Peer>& peers) {
  for (Peer& p : peers) p.watch.ring = p.ring.on;
  return parts(peers, &Peer::watch);
}

// This rank's addresses on rails 1.. and every rail's name (rails: main first).
std::vector<std::string> rail_addresses(const std::vector<Endpoint*>& rails) {
  std::vector<std::string> out;
  for (size_t r = 1; r < rails.size(); ++r) out.push_back(rails[r]->address());
  return out;
}

std::vector<std::string> domain_names(const std::vector<Endpoint*>& rails) {
  std::vector<std::string> out;
  for (const Endpoint* r : rails) out.push_back(r->domain_name());
  return out;
}

template <typename Field>
std::vector<Field> each(const std::vector<Peer>& peers, Field Peer::*field) {
  std::vector<Field> out;
  for (const Peer& p : peers) out.push_back(p.*field);
  return out;
}

}  // namespace

Router::Router(int rank, int size, const Options& opts, const std::atomic<bool>& aborted, Waiters& waiters,
               std::unique_ptr<Endpoint> main, std::unique_ptr<Endpoint> shm, std::vector<Peer> peers,
               std::vector<RingSegment> segments, Liveness liveness, std::vector<std::unique_ptr<Endpoint>> rails)
    : rank_(rank), size_(size), aborted_(aborted), waiters_(waiters), host_(each(peers, &Peer::host)),
      host_index_(each(peers, &Peer::host_index)),
      fabric_(*this, opts, std::move(main), std::move(shm), std::move(rails), routes(peers)),
      rails_(*this, fabric_, opts, rank, parts(peers, &Peer::rail), host_index_),
      watch_(*this, rank, size, watch_parts(peers), liveness, rail_addresses(fabric_.rails()),
             domain_names(fabric_.rails())),
      ring_(*this, fabric_, rank, size, parts(peers, &Peer::ring), std::move(segments)) {
  const Endpoint* m = fabric_.main();
  description_ = fmt::format("rank {}/{} {} on {}{}", rank_, size_, m->provider(), m->domain_name(),
                             m->needs_mr() ? " (buffers registered)" : "");
  description_ += rails_.describe();
  int local = 0;
  for (int q = 0; q < size_; ++q) local += fabric_.shm() && q != rank_ && peers[q].ep == fabric_.shm();
  if (fabric_.shm()) description_ += fmt::format(" + shm to {} rank(s) on this host", local);
  description_ += ring_.describe();
}

std::string Router::peer_name(int peer) const { return fmt::format("rank {} (host {})", peer, host_[peer]); }

void Router::post(const std::shared_ptr<Op>& op) {
  if (watch_.failing()) throw remote_error("rank {}: {}", rank_, watch_.failure());
  if (op->send && !ring_.exited(op->peer).empty()) throw remote_error("{}", ring_.exited(op->peer));
  if (ring_.has(op->peer)) {
    track(op);
    if (op->send) ring_.send(op);
    else ring_.recv(op);
  } else if (op->send && rails_.stripes(*op)) {
    rails_.send_striped(op);
  } else {
    rails_.route(*op);
    fabric_.start(op, true);
  }
}

// Marks op done (once) and, when the provider holds none of its pieces any more, lets it go.
void Router::finish(Op& op, std::optional<Error> error) {
  if (!op.done) {
    op.done = true;
    ++waiters_.completions;
    op.error = std::move(error);
    fabric_.forget_split(op);
    rails_.part_done(op);
  }
  if (op.fab.inflight > 0) return;
  // finish() may run more than once for an op (done, then its last piece back): count it once.
  // Erasing may destroy op, so nothing reads it afterwards.
  const auto it = active_.find(&op);
  fabric_.let_go(op, it != active_.end());
  if (it != active_.end()) active_.erase(it);
}

std::shared_ptr<Op> Router::keep(Op* op) const {
  const auto it = active_.find(op);
  return it == active_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Op>> Router::user_ops() const {
  std::vector<std::shared_ptr<Op>> ops;
  for (const auto& [raw, op] : active_)
    if (op->role == Op::Role::kUser && !op->done) ops.push_back(op);
  return ops;
}

bool Router::user_ops_with(int peer) const {
  for (const auto& [raw, op] : active_)
    if (op->peer == peer && op->role == Op::Role::kUser && !op->done) return true;
  return false;
}

void Router::lose(int peer, const std::string& detail, int reporter) {
  if (aborted_.load(std::memory_order_acquire) || !watch_.lose(peer, detail, reporter)) return;
  // Before anything fails: the callers may reuse those buffers, and peers pulling from them
  // must see the close (and read the lost rank from it).
  ring_.close_lost(peer);
  const Error e = remote_error("rank {}: {}", rank_, watch_.failure());
  for (auto& op : user_ops()) finish(*op, e);
  ring_.forget_pulled();
}

std::shared_ptr<Op> Router::post_internal(Op::Role role, int peer, char* buf, size_t len) {
  if (aborted_.load(std::memory_order_acquire) || !fabric_.route(peer).ep) return nullptr;
  const uint64_t tag = wire::control(wire::kWatch);
  auto op = new_op(role != Op::Role::kWatch, peer, tag, tag, buf, len);
  op->role = role;
  try {
    fabric_.start(op, false);  // no progress from here: this may run inside progress
  } catch (const Error& e) {
    log::warn(log::Subsys::kFabric, "rank {}: the peer watch could not post to {}: {}", rank_, peer_name(peer),
              e.what());
    return nullptr;
  }
  return op;
}

void Router::progress() {
  if (!aborted_.load(std::memory_order_acquire)) progress_now();
}

void Router::progress_now() {
  ring_.progress();
  fabric_.progress();
  if (!aborted_.load(std::memory_order_acquire)) watch_.probe();
  waiters_.announce();
}

std::vector<char> Router::busy() const {
  const std::vector<Endpoint*>& eps = fabric_.endpoints();
  std::vector<char> busy(eps.size(), 0);
  // The peer watch's standing receives do not count: a notice over shm may wait for the next
  // wake-up (at most a second), which is no reason to nap through every wait.
  for (const auto& [p, op] : active_)
    if (op->role != Op::Role::kWatch) {
      const Endpoint* ep = op->fab.on_fabric ? op->fab.ep : fabric_.route(op->peer).ep;
      for (size_t i = 0; i < eps.size(); ++i)
        if (eps[i] == ep) busy[i] = 1;
    }
  return busy;
}

void Router::close(const Error& e) {
  for (auto& [p, op] : active_) {
    if (!op->done) {
      op->done = true;
      op->error = e;
    }
    op->fab.mr.reset();  // the cache closes with its endpoint
  }
  active_.clear();
  watch_.close();
  ring_.close();
  rails_.close();
  fabric_.close();
}

}  // namespace trn::fabric
