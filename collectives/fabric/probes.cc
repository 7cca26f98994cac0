// The peer watch's probes (probes.h) and the liveness sockets they connect to.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "collectives/core/log.h"
#include "collectives/fabric/probes.h"

namespace trn::fabric {
namespace {

// How often a waiter probes the peers of its pending operations. A probe goes to a peer whose
// operation was pending at two ticks in a row, so a dead peer is found within two ticks.
constexpr auto kProbeTick = std::chrono::milliseconds(500);
// How long a probe's connect may go unanswered before the peer's host counts as gone: a live
// host's kernel answers at once, whatever its processes do.
constexpr auto kLiveTimeout = std::chrono::seconds(10);
// How long a probe on rail 1.. may go unanswered, while the peer answered on rail 0, before
// that rail counts as down.
constexpr auto kRailTimeout = std::chrono::seconds(3);

bool is_ip(const std::string& raw) {
  if (raw.size() == sizeof(sockaddr_in)) return reinterpret_cast<const sockaddr*>(raw.data())->sa_family == AF_INET;
  if (raw.size() == sizeof(sockaddr_in6)) return reinterpret_cast<const sockaddr*>(raw.data())->sa_family == AF_INET6;
  return false;
}

void set_port(sockaddr_storage* a, int port) {
  if (a->ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(a)->sin_port = htons(static_cast<uint16_t>(port));
  else reinterpret_cast<sockaddr_in6*>(a)->sin6_port = htons(static_cast<uint16_t>(port));
}

}  // namespace

Liveness open_liveness(const std::string& raw, bool every_address) {
  if (!is_ip(raw)) return {};
  sockaddr_storage a{};
  std::memcpy(&a, raw.data(), raw.size());
  set_port(&a, 0);
  if (every_address) {  // rails: peers probe it on each rail's address
    if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&a)->sin_addr.s_addr = htonl(INADDR_ANY);
    else reinterpret_cast<sockaddr_in6*>(&a)->sin6_addr = in6addr_any;
  }
  const int fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return {};
  socklen_t len = static_cast<socklen_t>(raw.size());
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd, SOMAXCONN) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    log::warn(log::Subsys::kFabric, "no liveness socket ({}): a dead peer is noticed only when an operation "
              "with it fails", std::strerror(errno));
    close(fd);
    return {};
  }
  const int port = ntohs(a.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&a)->sin_port
                                                 : reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return {fd, port};
}

int rail_socket(const std::string& local_raw) {
  if (!is_ip(local_raw)) return -1;
  sockaddr_storage a{};
  std::memcpy(&a, local_raw.data(), local_raw.size());
  set_port(&a, 0);
  const int fd = socket(a.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr*>(&a), static_cast<socklen_t>(local_raw.size())) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

socklen_t liveness_address(const std::string& raw, int port, sockaddr_storage* out) {
  if (!is_ip(raw) || port <= 0 || port > 65535) return 0;
  *out = sockaddr_storage{};
  std::memcpy(out, raw.data(), raw.size());
  set_port(out, port);
  return static_cast<socklen_t>(raw.size());
}

Probes::Probes(Hub& hub, int rank, int size, std::vector<WatchPeer> peers, Liveness liveness,
               std::vector<std::string> rail_addresses)
    : hub_(hub), rank_(rank), size_(size), peers_(std::move(peers)), liveness_(liveness),
      rail_addresses_(std::move(rail_addresses)) {}

Probes::~Probes() {
  close();
  if (liveness_.fd >= 0) ::close(liveness_.fd);
}

void Probes::close() {
  closed_ = true;
  for (auto& p : peers_) {
    if (p.live_fd >= 0) ::close(std::exchange(p.live_fd, -1));
    for (auto& rp : p.rail_probes)
      if (rp.fd >= 0) ::close(std::exchange(rp.fd, -1));
    p.ring = false;
  }
}

void Probes::start() {
  const auto now = Clock::now();
  if (now < next_probe_ || closed_) return;
  next_probe_ = now + kProbeTick;
  // Peers' finished probes wait in the backlog: take them, so it never fills.
  while (liveness_.fd >= 0) {
    const int fd = accept4(liveness_.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) break;
    ::close(fd);
  }
  // A peer is probed when one operation with it was pending at two ticks in a row: not merely
  // one at each, since a peer that finished its part of the last collective and exited leaves
  // its final bytes to be read here, and a probe then would take its normal exit for a loss.
  ++probe_tick_;
  std::vector<char> waiting(size_, 0);
  for (const auto& op : hub_.user_ops()) {
    if (peers_[op->peer].ring) continue;
    if (op->seen_tick == 0) op->seen_tick = probe_tick_;
    else if (op->seen_tick < probe_tick_) waiting[op->peer] = 1;
  }
  for (int q = 0; q < size_ && !hub_.failing(); ++q) {
    WatchPeer& p = peers_[q];
    if (waiting[q] && p.live_len != 0 && p.live_fd < 0 && !start_probe(q, now)) return;
  }
}

bool Probes::start_probe(int q, Clock::time_point now) {
  WatchPeer& p = peers_[q];
  p.live_fd = socket(p.live_addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (p.live_fd < 0) return true;
  p.live_since = now;
  log::trace(log::Subsys::kFabric, "rank {}: probing {}", rank_, hub_.peer_name(q));
  if (::connect(p.live_fd, reinterpret_cast<sockaddr*>(&p.live_addr), p.live_len) != 0 && errno != EINPROGRESS) {
    const int err = errno;
    ::close(std::exchange(p.live_fd, -1));
    if (err == ECONNREFUSED) hub_.lose(q, "its process is gone (it no longer accepts connections on its host)");
    return false;
  }
  // And on each other rail: traffic waiting on a rail that went down looks like a slow peer.
  for (size_t i = 0; i < p.rail_probes.size(); ++i) {
    auto& rp = p.rail_probes[i];
    if (rp.len == 0 || rp.fd >= 0 || i >= rail_addresses_.size()) continue;
    rp.fd = rail_socket(rail_addresses_[i]);
    if (rp.fd < 0) continue;
    rp.since = now;
    rp.failed = 0;
    if (::connect(rp.fd, reinterpret_cast<sockaddr*>(&rp.addr), rp.len) != 0 && errno != EINPROGRESS)
      rp.failed = errno;  // at once (the rail's interface is down): judged once rail 0 answered
  }
  return true;
}

std::optional<RailDown> Probes::check() {
  const auto now = Clock::now();
  std::optional<RailDown> down;
  for (int q = 0; q < size_ && !down && !hub_.failing(); ++q) {
    down = check_rails(q, now);
    check_live(q, now);
  }
  return down;
}

void Probes::check_live(int q, Clock::time_point now) {
  WatchPeer& p = peers_[q];
  if (p.live_fd < 0) return;
  pollfd fd{p.live_fd, POLLOUT, 0};
  if (poll(&fd, 1, 0) <= 0) {
    if (now - p.live_since < kLiveTimeout) return;
    ::close(std::exchange(p.live_fd, -1));
    if (hub_.user_ops_with(q))
      hub_.lose(q, fmt::format("its host did not answer a connection attempt for {} s",
                               std::chrono::duration_cast<std::chrono::seconds>(kLiveTimeout).count()));
    return;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(p.live_fd, SOL_SOCKET, SO_ERROR, &err, &len);
  ::close(std::exchange(p.live_fd, -1));
  if (err == 0) p.live_answered = now;
  // Refused, reset or unreachable: nobody listens there any more. Nothing pending with it:
  // it finished and left, which is no loss.
  if (err != 0 && hub_.user_ops_with(q))
    hub_.lose(q, fmt::format("its process is gone: connecting to it failed ({})", std::strerror(err)));
}

std::optional<RailDown> Probes::check_rails(int q, Clock::time_point now) {
  WatchPeer& p = peers_[q];
  for (size_t i = 0; i < p.rail_probes.size(); ++i) {
    auto& rp = p.rail_probes[i];
    if (rp.fd < 0) continue;
    int err = rp.failed;
    if (err == 0) {
      pollfd fd{rp.fd, POLLOUT, 0};
      if (poll(&fd, 1, 0) <= 0) {
        if (now - rp.since < kRailTimeout) continue;
        err = ETIMEDOUT;
      } else {
        socklen_t len = sizeof(err);
        getsockopt(rp.fd, SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    // A failure is judged against rail 0's probe of the same round: wait for its answer.
    if (err != 0 && p.live_answered < rp.since && now - rp.since < kRailTimeout) continue;
    ::close(std::exchange(rp.fd, -1));
    // Down only while the peer's host answers on rail 0 (else the host is the one gone, which
    // the probe on rail 0 finds).
    if (err != 0 && p.live_answered >= rp.since && hub_.user_ops_with(q))
      return RailDown{i + 1, err == ETIMEDOUT
                           ? fmt::format("a connection on it to {} got no answer for {} s while rail 0 answered",
                                         hub_.peer_name(q),
                                         std::chrono::duration_cast<std::chrono::seconds>(kRailTimeout).count())
                           : fmt::format("connecting on it to {} failed ({}) while rail 0 answered",
                                         hub_.peer_name(q), std::strerror(err))};
  }
  return std::nullopt;
}

}  // namespace trn::fabric
