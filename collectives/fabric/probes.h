// The peer watch's probes (peer_watch.h): connects to peers' liveness sockets that tell a slow
// peer from a dead one, and a rail that stopped carrying traffic from a host that is gone.
// Internal to collectives/fabric.
//
// A peer that a caller's operation is still waiting on at two probe ticks in a row gets a probe:
// a connect to its liveness socket, started without blocking and checked as progress runs. Its
// kernel completes the connect while the process lives, busy or not, so a slow peer is never
// taken for a dead one; a dead process's host refuses it at once, and a host that does not
// answer at all within kLiveTimeout counts as gone too. A message would not do: rxm queues a send
// to a peer whose connection broke, and it neither completes nor fails. With rails, each rail's
// address is probed as well. All calls are made under the transport's lock.
#pragma once

#include <sys/socket.h>

#include <optional>
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

// A rail found down: which, and what was seen.
struct RailDown {
  size_t rail = 0;
  std::string detail;
};

class Probes {
 public:
  // rail_addresses: this rank's raw address on rails 1..
  Probes(Hub& hub, int rank, int size, std::vector<WatchPeer> peers, Liveness liveness,
         std::vector<std::string> rail_addresses);
  ~Probes();
  Probes(const Probes&) = delete;
  Probes& operator=(const Probes&) = delete;

  bool ring(int peer) const { return peers_[peer].ring; }
  // The connects in flight: a peer whose host refused or never answered is lost (Hub::lose), if
  // the caller still waits on it; a rail whose probe failed while rail 0 answered is returned.
  std::optional<RailDown> check();
  // At most every kProbeTick: probes the peers an operation waited on at two ticks in a row.
  void start();
  void close();

 private:
  bool start_probe(int peer, Clock::time_point now);  // false: its connect failed at once
  std::optional<RailDown> check_rails(int peer, Clock::time_point now);
  void check_live(int peer, Clock::time_point now);

  Hub& hub_;
  const int rank_, size_;
  std::vector<WatchPeer> peers_;
  Liveness liveness_;
  std::vector<std::string> rail_addresses_;
  bool closed_ = false;
  uint64_t probe_tick_ = 0;  // probe ticks so far
  Clock::time_point next_probe_{};
};

}  // namespace trn::fabric
