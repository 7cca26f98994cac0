// The router: owns the channels and the peer watch, sends each operation to its channel, keeps
// the operations in flight, and carries out what a loss means. Internal to collectives/fabric.
//
//   post ──> ring peer (same host, rings up)     ──> RingChannel    (ring_channel.h)
//        ──> a striped send to another host      ──> RailsChannel   (rails_channel.h) ──┐
//        ──> anything else: routed by the rails  ──> FabricChannel  (fabric_channel.h) <┘
//   PeerWatch (peer_watch.h): suspect, lose, probe
//
// The channels call back through Hub (op.h), which the router implements: finishing an op lets
// each channel drop its slice; a lost peer closes the rings (peers read the lost rank there) and
// fails every caller's op with the watch's error. All calls are made under the transport's lock.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "collectives/fabric/fabric_channel.h"
#include "collectives/fabric/peer_watch.h"
#include "collectives/fabric/rails_channel.h"
#include "collectives/fabric/ring_channel.h"
#include "collectives/fabric/waiters.h"

namespace trn::fabric {

// What connect found out about one rank: its host, the endpoint and address that reach it, and
// each channel's part.
struct Peer {
  std::string host;
  int host_index = 0;  // PointToPoint::host_of: its host's lowest rank
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  RailPeer rail;
  RingPeer ring;
  WatchPeer watch;
};

class Router final : public Hub {
 public:
  // aborted and waiters belong to the transport and outlive the router.
  Router(int rank, int size, const Options& opts, const std::atomic<bool>& aborted, Waiters& waiters,
         std::unique_ptr<Endpoint> main, std::unique_ptr<Endpoint> shm, std::vector<Peer> peers,
         std::vector<RingSegment> segments, Liveness liveness, std::vector<std::unique_ptr<Endpoint>> rails);

  void start() { watch_.start(); }
  // Throws what fails every new op (a lost peer or rail, a ring peer that ended), else hands op
  // to its channel.
  void post(const std::shared_ptr<Op>& op);
  const std::string& describe() const { return description_; }
  int host_of(int peer) const { return host_index_.at(peer); }
  bool ring(int peer) const { return ring_.has(peer); }
  // The endpoint op goes through (what a timeout names; nullptr once closed).
  const Endpoint* endpoint_of(const Op& op) const { return op.fab.ep ? op.fab.ep : fabric_.route(op.peer).ep; }
  const std::vector<Endpoint*>& endpoints() const { return fabric_.endpoints(); }
  // Per endpoints(): whether ops other than the watch's standing receives wait on it (a ring op
  // counts as its peer's endpoint's: rings are polled, never slept on).
  std::vector<char> busy() const;
  uint64_t registrations() const { return fabric_.registrations(); }
  void flush_notices() { watch_.flush_notices(); }
  void close(const Error& e);  // every op fails with e; the channels close

  // Hub.
  void finish(Op& op, std::optional<Error> error) override;
  void track(const std::shared_ptr<Op>& op) override { active_.emplace(op.get(), op); }
  bool tracked(const Op& op) const override { return active_.count(const_cast<Op*>(&op)) != 0; }
  std::shared_ptr<Op> keep(Op* op) const override;
  std::vector<std::shared_ptr<Op>> user_ops() const override;
  bool user_ops_with(int peer) const override;
  void suspect(int peer, const std::string& detail) override { watch_.suspect(peer, detail); }
  void lose(int peer, const std::string& detail, int reporter = -1) override;
  bool failing() const override { return watch_.failing() || aborted_.load(std::memory_order_acquire); }
  void stripe_header(const std::shared_ptr<Op>& op, size_t got) override { rails_.on_header(op, got); }
  void heard(int peer) override { watch_.heard(peer); }
  std::shared_ptr<Op> post_internal(Op::Role role, int peer, char* buf, size_t len) override;
  void progress() override;
  void progress_now() override;
  std::string peer_name(int peer) const override;

 private:
  const int rank_, size_;
  const std::atomic<bool>& aborted_;
  Waiters& waiters_;
  std::vector<std::string> host_;
  std::vector<int> host_index_;
  std::string description_;
  std::unordered_map<Op*, std::shared_ptr<Op>> active_;  // ops some channel may still touch
  // Built in this order: each takes its part of the peers; the watch reads which peers have
  // rings before the ring channel takes them.
  FabricChannel fabric_;
  RailsChannel rails_;
  PeerWatch watch_;
  RingChannel ring_;
};

}  // namespace trn::fabric
