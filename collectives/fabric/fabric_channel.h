// The libfabric channel: the endpoints (main, shm, rails 1..) and what is posted on them.
// Internal to collectives/fabric.
//
// A message travels as pieces of at most the provider's max_msg_size (tag.h); a send keeps up
// to kSendWindow of them in flight, a receive one. Pieces of ops with one (send?, peer, tag,
// endpoint) go in post order: a split op's later pieces wait for earlier split ops on that key.
// A post the provider refuses for now (-FI_EAGAIN) waits in a per-(direction, peer) queue, in
// order, and is retried at each progress. Buffers of providers that need registration
// (FI_MR_LOCAL) are registered through the endpoint's cache (mr_cache.h) and released when the
// op is let go. Completions are read from every endpoint with ops in flight; an error entry
// fails its op, and makes its peer a suspect of the peer watch unless the error was the
// receiver's (truncation).
//
// Each op is routed before it starts (Op::fab.ep and addr: the rails channel's choice, or the
// peer's own endpoint and address when that is unset). All calls are made under the
// transport's lock (transport.h).
#pragma once

#include <list>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/op.h"

namespace trn::fabric {

class FabricChannel {
 public:
  struct Route {
    Endpoint* ep = nullptr;
    fi_addr_t addr = FI_ADDR_UNSPEC;
  };
  // routes: per rank, the endpoint (main or shm) and address that reach it.
  FabricChannel(Hub& hub, const Options& opts, std::unique_ptr<Endpoint> main, std::unique_ptr<Endpoint> shm,
                std::vector<std::unique_ptr<Endpoint>> rails, std::vector<Route> routes);

  Endpoint* main() const { return main_.get(); }
  Endpoint* shm() const { return shm_.get(); }
  std::vector<Endpoint*> rails() const;  // every rail: main first
  const std::vector<Endpoint*>& endpoints() const { return endpoints_; }  // main, shm (or null), rails 1..
  Route route(int peer) const { return routes_[peer]; }

  // Hands op to its endpoint: posts its first pieces, or queues it. retry: on -FI_EAGAIN
  // progress once and try again (not from inside progress). Throws when registering its buffer
  // fails for an op nobody tracks yet (the caller's post); otherwise that fails the op.
  void start(const std::shared_ptr<Op>& op, bool retry);
  // Reads completions from every busy endpoint, then posts what waits.
  void progress();
  // A receive that takes no more pieces of its own (a stripe header came).
  void stop_pieces(Op& op);
  void forget_split(Op& op);
  // op is let go: its registration is released, and when counted its endpoint has one op less.
  void let_go(Op& op, bool counted);
  // Whether every piece of a send is out and back.
  static bool sent_all(const Op& op) { return op.fab.posted == op.fab.max_pieces && op.fab.inflight == 0; }
  uint64_t registrations() const;
  void close();  // teardown: forgets every op and closes the endpoints

 private:
  using Key = std::tuple<bool, int, uint64_t, const Endpoint*>;  // send?, peer, wire tag, endpoint

  bool post_pieces(Op& op);  // false when the provider said -FI_EAGAIN before the first piece
  bool can_post(const Op& op) const;
  void drain_queues();
  void read(Endpoint& ep);
  void on_complete(PieceContext& c, const fi_cq_tagged_entry& e);
  void on_error(Endpoint& ep);
  int endpoint_index(const Op& op) const;

  Hub& hub_;
  const size_t max_piece_;
  std::unique_ptr<Endpoint> main_, shm_;
  std::vector<std::unique_ptr<Endpoint>> extra_rails_;  // rails 1..
  std::vector<Endpoint*> endpoints_;
  std::vector<size_t> busy_;  // per endpoints_: ops not yet let go (their queues need polling)
  std::vector<Route> routes_;
  std::map<std::pair<bool, int>, std::list<std::shared_ptr<Op>>> queued_;  // first piece not posted
  size_t queued_count_ = 0;
  std::list<std::shared_ptr<Op>> continuing_;  // split ops with pieces left to post
  std::map<Key, std::list<Op*>> split_order_;  // may-split ops per key, in post order
};

}  // namespace trn::fabric
