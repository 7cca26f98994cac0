// The peer watch: notices a lost peer and tells the other ranks. Internal to collectives/fabric.
//
// A peer is lost when an operation the caller still waits on with it fails because of it (the
// provider reports the connection broken, a probe to it fails, its process on this host ended,
// it wrote garbage), or when another rank says so. A lost peer fails every pending and later
// operation of the transport, with every peer, naming it; and this rank tells others: rank + 1,
// + 2, + 4, ... by a notice on the fabric, which each rank that hears it forwards the same way,
// and every same-host ring peer through its ring's closed word. So every rank learns of it within
// a few hops, whoever it waits for.
//
// Its interface to the rest of the transport is narrow: suspect (a broken connection, blamed
// after a grace), lose (the first loss is the one every operation names), lose a rail, and
// probe (each progress's end: notices heard, suspects past their grace, probes sent and
// answered). What a loss does to the operations and the rings is the router's (router.h).
// All calls are made under the transport's lock.
#pragma once

#include <array>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "collectives/core/deadline.h"
#include "collectives/fabric/op.h"
#include "collectives/fabric/probes.h"

namespace trn::fabric {

class PeerWatch {
 public:
  // rail_addresses: this rank's raw address on rails 1..; rail_names: every rail's name.
  PeerWatch(Hub& hub, int rank, int size, std::vector<WatchPeer> peers, Liveness liveness,
            std::vector<std::string> rail_addresses, std::vector<std::string> rail_names);
  ~PeerWatch();
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  void start();  // the standing receives
  void suspect(int peer, const std::string& detail);
  // True when this is the first loss: the caller then fails what is pending (failure()).
  bool lose(int peer, const std::string& detail, int reporter = -1);
  void probe();
  void heard(int peer) { heard_.push_back(peer); }  // read after the queues (probe)
  bool failing() const { return lost_ >= 0 || !rail_lost_.empty(); }
  const std::string& failure() const { return lost_ >= 0 ? lost_text_ : rail_lost_; }
  void flush_notices();  // teardown: lets notices go out (bounded) before closing
  void close();

 private:
  void post_watch(int peer);  // the standing receive for probes and notices from peer
  // A rail that stopped carrying traffic (detail: to whom, how it was found): every pending and
  // later operation fails, naming it (a recoverable error: the next generation's connect leaves
  // the rail out). No notices: each rank finds it, or hears of the failure from the job.
  void lose_rail(size_t rail, const std::string& detail);
  void read_heard();
  void send_notices();

  static constexpr size_t kWatchBytes = 256;  // longest probe or notice
  Hub& hub_;
  const int rank_, size_;
  Probes probes_;
  std::vector<std::string> rail_names_;
  bool closed_ = false;
  int lost_ = -1;           // the first rank lost, or -1
  std::string rail_lost_;   // the error of a rail lost, or empty
  int lost_reporter_ = -1;  // who told this rank, or -1
  // A connection that broke is blamed on its peer only after a short grace: a survivor that saw
  // the real loss first, told this rank and exited also breaks its connections, and its notice
  // (naming the rank really lost) may be read just after.
  int suspect_ = -1;
  std::string suspect_detail_;
  Clock::time_point suspect_since_{};
  std::string lost_detail_, lost_text_;  // what happened; the error every op gets
  bool notices_due_ = false;             // lost, notices not posted yet
  std::vector<std::shared_ptr<Op>> watch_;  // per peer: the standing receive
  std::vector<std::array<char, kWatchBytes>> watch_buf_;
  std::vector<int> heard_;   // peers whose standing receive completed
  std::list<std::shared_ptr<Op>> notices_;  // notices in flight
  std::deque<std::string> notice_bytes_;    // their payloads
};

}  // namespace trn::fabric
