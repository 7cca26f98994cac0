// The rails channel: which rail a message to another host takes, and striping (rails.h has the
// protocol and its pure parts). Internal to collectives/fabric.
//
// It routes an op (sets Op::fab.ep and addr) before the libfabric channel starts it, and turns a
// striped message into parts (a header and a stripe per rail), each an op of its own on the
// libfabric channel, whose parent completes when the last part did. All calls are made under
// the transport's lock (transport.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives/fabric/fabric_channel.h"
#include "collectives/fabric/op.h"

namespace trn::fabric {

// A peer's rails: its address on each (empty: it is reached through its own endpoint alone), its
// own rail, its near rails (what its messages to other hosts spread over), whether its rails take
// striped messages, and the sequence number of the next message this rank stripes to it.
struct RailPeer {
  std::vector<fi_addr_t> addr;
  int own_rail = 0;
  std::vector<int> near_rails;
  bool stripes = false;
  uint64_t next_stripe = 0;
};

class RailsChannel {
 public:
  // peers and host_index: per rank (host_index: the lowest rank of its host). The rails are the
  // libfabric channel's.
  RailsChannel(Hub& hub, FabricChannel& fabric, const Options& opts, int rank, std::vector<RailPeer> peers,
               std::vector<int> host_index);

  size_t count() const { return rails_.size(); }
  const Endpoint& rail(size_t r) const { return *rails_.at(r); }
  std::string describe() const;  // empty with one rail

  // Whether op, a send, goes striped.
  bool stripes(const Op& op) const;
  // Sets op's endpoint and address when it goes by a rail (a user message to a peer with rails).
  void route(Op& op) const;
  // A striped send: the header and a stripe per rail as parts of op.
  void send_striped(const std::shared_ptr<Op>& op);
  // A receive whose first piece brought a header (got bytes): its stripes' receives.
  void on_header(const std::shared_ptr<Op>& op, size_t got);
  // part is done (completed or failed): its parent learns of it.
  void part_done(Op& part);
  void close() { rails_.clear(); }

 private:
  int rail_of(const Op& op) const;
  void start_part(const std::shared_ptr<Op>& parent, bool send, int rail, uint64_t wire_tag, char* buf, size_t len,
                  uint64_t cq_data);
  void settle(Op& parent);  // finishes it once no part is left

  Hub& hub_;
  FabricChannel& fabric_;
  const size_t stripe_min_;
  const int rank_;
  std::vector<RailPeer> peers_;
  std::vector<int> host_;
  std::vector<Endpoint*> rails_;  // main first
  bool stripe_ = false;  // this rank's rails take striped messages
};

}  // namespace trn::fabric
