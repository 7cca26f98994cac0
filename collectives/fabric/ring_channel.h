// The shm ring channel: messages to peers on this host through trn's shared-memory rings
// (shm_ring.h has the rings themselves). Internal to collectives/fabric.
//
// Every message to a ring peer is matched through its ring: one of up to the peer's eager limit
// (Options::ring_eager) travels in it. A longer one sends only a "pull" record there ({length,
// sequence, address}); once the record matched its receive, the receiver copies the bytes
// straight from the sender's memory with process_vm_readv and writes an "ack" record
// ({sequence}) into its own ring, which completes the send. Where connect found that the peer
// cannot read this rank's memory (another pid namespace, ptrace restrictions), a "long" record
// ({length, sequence}) goes instead and the bytes take libfabric's shm single-copy path under a
// tag of their own (wire::bulk), on the libfabric channel.
//
// The pull path has no lock a dying peer could hold: a rank killed mid-message makes
// process_vm_readv fail, or leaves an ack unwritten until the peer's exit is noticed (progress
// polls peers' pidfds every 10 ms). A rank that aborts, or loses a rank, marks its rings closed
// first; a receiver that sees that after pulling fails the receive, since the bytes may have
// changed under it. A peer that broke its ring, or whose process ended while something still
// waited on it, is lost (the peer watch's lose). All calls are made under the transport's lock.
#pragma once

#include <deque>
#include <list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/core/deadline.h"
#include "collectives/fabric/fabric_channel.h"
#include "collectives/fabric/op.h"
#include "collectives/fabric/shm_ring.h"

namespace trn::fabric {

// A record that arrived in a ring before its receive was posted.
struct Unexpected {
  uint64_t tag = 0;
  uint32_t kind = 0;
  std::vector<char> data;
};

// The rings with one peer on this host: out is this rank's ring in the peer's segment, in the
// peer's ring in this rank's segment.
struct RingPeer {
  bool on = false;
  RingWriter out;
  RingReader in;
  std::deque<std::shared_ptr<Op>> sends;  // records not yet written, in post order
  std::list<std::shared_ptr<Op>> recvs;   // receives waiting for their record, in post order
  std::deque<Unexpected> unexpected;      // records that came before their receive
  uint64_t next_bulk = 0;                 // sequence number of the next long message out
  size_t eager = 0;                       // messages up to this long travel in out
  // Pulls (kRingPull): pull_out when the peer reads this rank's long messages from its memory,
  // pull_in when this rank reads the peer's. pid is the peer's process (checked at connect).
  bool pull_out = false, pull_in = false;
  int pid = 0;
  int pidfd = -1;  // readable once the peer's process ended (pidfd_open); owned by the channel
  // Acks owed to the peer, not yet written (its ring was full), each with the receive that
  // completes once its ack is out: a rank that saw its receive complete may exit at once.
  std::deque<std::pair<uint64_t, std::shared_ptr<Op>>> acks;
  std::map<uint64_t, std::shared_ptr<Op>> pulled;  // long sends the peer has yet to read, by sequence
  std::string exited;                               // non-empty once the peer's process ended
};

class RingChannel {
 public:
  // peers: per rank; segments: the ring segments the peers' rings point into.
  RingChannel(Hub& hub, FabricChannel& fabric, int rank, int size, std::vector<RingPeer> peers,
              std::vector<RingSegment> segments);
  ~RingChannel();
  RingChannel(const RingChannel&) = delete;
  RingChannel& operator=(const RingChannel&) = delete;

  bool has(int peer) const { return peers_[peer].on; }
  const std::string& exited(int peer) const { return peers_[peer].exited; }
  std::string describe() const;  // empty without ring peers

  void send(const std::shared_ptr<Op>& op);
  void recv(const std::shared_ptr<Op>& op);
  // Notices ended peers (at most every 10 ms), writes what waits, matches what arrived.
  void progress();
  // This rank lost rank `lost`: tells every ring peer through the closed word, before any
  // buffer is let go, and forgets the long sends peers were to read.
  void close_lost(int lost);
  void forget_pulled();
  void close();  // teardown: peers must not pull from this rank's buffers any more

 private:
  void flush(RingPeer& p);  // writes queued records while the ring has room
  void drain(RingPeer& p);  // matches arrived records against posted receives
  void deliver(const std::shared_ptr<Op>& op, uint32_t kind, const char* data, size_t len);
  void pull(const std::shared_ptr<Op>& op, const RingPull& rec);
  bool read_bytes(const std::shared_ptr<Op>& op, const RingPull& rec);
  void on_ack(RingPeer& p, const char* data, size_t len);
  void check_exits();
  void peer_exited(int peer);
  std::string exit_text(int peer) const;
  static bool ending(const RingPeer& p);  // whether p's process ends within 100 ms
  int index(const RingPeer& p) const { return static_cast<int>(&p - peers_.data()); }

  Hub& hub_;
  FabricChannel& fabric_;
  const int rank_, size_;
  std::vector<RingPeer> peers_;
  std::vector<RingSegment> segments_;
  std::vector<int> ring_peers_;  // peers with rings
  Clock::time_point next_exit_check_{};
};

}  // namespace trn::fabric
