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

#include <sys/socket.h>

#include <array>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "collectives/core/deadline.h"
#include "collectives/fabric/op.h"

namespace trn::fabric {

// A listening socket on the main endpoint's address whose only use is that peers can connect to
// it: the kernel completes a connect while the process lives, whether or not it is making
// progress, and refuses it once the process is gone. Port 0 when there is none.
struct Liveness {
  int fd = -1;
  int port = 0;
};
// Opens one on the address of a tcp endpoint (raw: its fi_getname), or on every address of the
// host with its port (rails: one per rail's address); none for other providers.
Liveness open_liveness(const std::string& raw, bool every_address = false);
// A non-blocking stream socket bound to the address of a local endpoint (raw, port 0), so that a
// connect from it leaves through that endpoint's interface (a probe of one rail); -1 when raw is
// not an ip address or the bind fails.
int rail_socket(const std::string& local_raw);
// A peer's liveness address: its endpoint address (raw) with the port it published.
socklen_t liveness_address(const std::string& raw, int port, sockaddr_storage* out);

// What the watch knows of one peer: its liveness socket's address (live_len 0: none), a probe's
// connect to it in flight (live_fd) since live_since, and when one last completed.
struct WatchPeer {
  sockaddr_storage live_addr{};
  socklen_t live_len = 0;
  int live_fd = -1;
  Clock::time_point live_since{};
  Clock::time_point live_answered{};
  // Rails 1..: a probe on each rail's address as well (index r - 1), to tell a rail that stopped
  // carrying traffic from a host that is gone.
  struct RailProbe {
    sockaddr_storage addr{};
    socklen_t len = 0;
    int fd = -1;
    int failed = 0;  // errno of a connect that failed at once
    Clock::time_point since{};
  };
  std::vector<RailProbe> rail_probes;
  bool ring = false;  // watched through its pidfd and ring (ring_channel.h), not here
};

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
  void start_probes();
  bool start_probe(int peer, Clock::time_point now);  // false: its connect failed at once
  void check_liveness();  // connects in flight: refused means the peer's process is gone
  void check_rails(int peer, Clock::time_point now);
  void send_notices();

  static constexpr size_t kWatchBytes = 256;  // longest probe or notice
  Hub& hub_;
  const int rank_, size_;
  std::vector<WatchPeer> peers_;
  Liveness liveness_;
  std::vector<std::string> rail_addresses_, rail_names_;
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
  uint64_t probe_tick_ = 0;  // probe ticks so far
  std::vector<int> heard_;   // peers whose standing receive completed
  std::list<std::shared_ptr<Op>> notices_;  // notices in flight
  std::deque<std::string> notice_bytes_;    // their payloads
  Clock::time_point next_probe_{};
};

}  // namespace trn::fabric
