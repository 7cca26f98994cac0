// The peer watch (peer_watch.h): how it notices a lost peer and tells the other ranks.
//
// Why: over tcp (rxm) a receive is not tied to a connection, so when a peer dies the provider
// fails only the sends in flight to it. A rank waiting to receive from the dead rank, or from a
// live rank that itself waits for the dead one, would wait for its whole deadline. So:
//  - Probes: a peer that a caller's operation is still waiting on at two probe ticks in a row
//    gets a probe: a connect to its liveness socket (peer_watch.h), started without blocking and
//    checked as progress runs. Its kernel completes the connect while the process lives, busy or
//    not, so a slow peer is never taken for a dead one; a dead process's host refuses it at
//    once, and a host that does not answer at all within kLiveTimeout counts as gone too. A
//    message would not do: rxm queues a send to a peer whose connection broke, and it neither
//    completes nor fails.
//  - Notices: a rank that loses a peer sends "L<rank> <what happened>" to rank + 1, + 2, + 4, ...
//    (mod size, skipping the lost rank), and every rank that hears one loses that peer too and
//    forwards it the same way, so every rank hears it within log2(size) hops even if some of the
//    paths run through the dead rank. Same-host peers with rings hear it through the ring's
//    closed word instead (checked with the peers' pidfds).
//  - Every rank keeps one standing receive (kWatchBytes) for probes and notices from each peer
//    it reaches through an endpoint (not through rings).
// Ring peers on this host are watched through their pidfds instead.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "collectives/core/log.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/peer_watch.h"

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
// How long teardown lets notices go out before it closes the endpoints.
constexpr auto kNoticeFlush = std::chrono::milliseconds(300);
// How long a broken connection's peer stays a suspect before it is named the lost rank: a
// notice naming the rank that really died (sent by whoever found it) may still be on its way.
// A survivor that aborted on such a notice closes its connections, and on a loaded host a third
// rank saw that close 0.36 s before the notice and named the survivor; 1 s leaves the notices
// their time, and a broken connection costs one second more only when no notice ever comes.
constexpr auto kSuspectGrace = std::chrono::seconds(1);

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

PeerWatch::PeerWatch(Hub& hub, int rank, int size, std::vector<WatchPeer> peers, Liveness liveness,
                     std::vector<std::string> rail_addresses, std::vector<std::string> rail_names)
    : hub_(hub), rank_(rank), size_(size), peers_(std::move(peers)), liveness_(liveness),
      rail_addresses_(std::move(rail_addresses)), rail_names_(std::move(rail_names)) {}

PeerWatch::~PeerWatch() {
  close();
  if (liveness_.fd >= 0) ::close(liveness_.fd);
}

void PeerWatch::start() {
  static_assert(kWatchBytes >= kNoticeBytes, "a notice fits the standing receive");
  watch_.resize(size_);
  watch_buf_.resize(size_);
  for (int q = 0; q < size_; ++q)
    if (q != rank_ && !peers_[q].ring) post_watch(q);
}

void PeerWatch::post_watch(int peer) {
  watch_[peer] = hub_.post_internal(Op::Role::kWatch, peer, watch_buf_[peer].data(), kWatchBytes);
}

bool PeerWatch::lose(int peer, const std::string& detail, int reporter) {
  if (lost_ >= 0) return false;  // the first loss is the one every operation names
  lost_ = peer;
  lost_reporter_ = reporter;
  lost_detail_ = detail;
  lost_text_ = reporter < 0 ? fmt::format("{} was lost: {}", hub_.peer_name(peer), detail)
                            : fmt::format("{} was lost ({} reported: {})", hub_.peer_name(peer),
                                          hub_.peer_name(reporter), detail);
  log::error(log::Subsys::kFabric, "rank {}: {}; every pending and later operation of this rank fails", rank_,
             lost_text_);
  notices_due_ = true;
  return true;
}

void PeerWatch::lose_rail(size_t rail, const std::string& detail) {
  if (lost_ >= 0 || !rail_lost_.empty()) return;
  const std::string name = rail < rail_names_.size() ? rail_names_[rail] : std::to_string(rail);
  rail_lost_ = fmt::format("fabric rail {} ({}) is down: {}; the job's next start leaves it out (trnrun "
                           "--recovery in-place restarts it in place)", rail, name, detail);
  log::error(log::Subsys::kFabric, "rank {}: {}; every pending and later operation of this rank fails", rank_,
             rail_lost_);
  const Error e = remote_error("rank {}: {}", rank_, rail_lost_);
  for (auto& op : hub_.user_ops()) hub_.finish(*op, e);
}

void PeerWatch::suspect(int peer, const std::string& detail) {
  if (lost_ >= 0 || suspect_ >= 0) return;
  suspect_ = peer;
  suspect_detail_ = detail;
  suspect_since_ = Clock::now();
}

void PeerWatch::probe() {
  read_heard();
  // No notice named another rank within the grace: the broken connection's peer is the lost one.
  if (lost_ < 0 && suspect_ >= 0 && Clock::now() - suspect_since_ >= kSuspectGrace)
    hub_.lose(suspect_, suspect_detail_);
  if (lost_ < 0) check_liveness();
  if (lost_ < 0) start_probes();
  if (notices_due_) send_notices();
}

void PeerWatch::read_heard() {
  for (int q : std::exchange(heard_, {})) {
    const std::shared_ptr<Op> op = watch_[q];
    if (!op) continue;
    const std::string_view msg(watch_buf_[q].data(), std::min(op->bytes, kWatchBytes));
    try {
      const Notice n = decode_notice(msg, size_);  // "L<rank> <what happened>"
      hub_.lose(n.lost, n.detail, q);
    } catch (const Error& e) {  // not a notice: nothing else comes here
      log::warn(log::Subsys::kFabric, "rank {}: ignored a message from {} on the peer watch: {}", rank_,
                hub_.peer_name(q), e.what());
    }
    post_watch(q);  // buffer free again: the op is done
  }
}

void PeerWatch::start_probes() {
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
  for (int q = 0; q < size_ && lost_ < 0; ++q) {
    WatchPeer& p = peers_[q];
    if (waiting[q] && p.live_len != 0 && p.live_fd < 0 && !start_probe(q, now)) return;
  }
}

bool PeerWatch::start_probe(int q, Clock::time_point now) {
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

void PeerWatch::check_rails(int q, Clock::time_point now) {
  WatchPeer& p = peers_[q];
  for (size_t i = 0; i < p.rail_probes.size() && rail_lost_.empty(); ++i) {
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
      lose_rail(i + 1, err == ETIMEDOUT
                           ? fmt::format("a connection on it to {} got no answer for {} s while rail 0 answered",
                                         hub_.peer_name(q),
                                         std::chrono::duration_cast<std::chrono::seconds>(kRailTimeout).count())
                           : fmt::format("connecting on it to {} failed ({}) while rail 0 answered",
                                         hub_.peer_name(q), std::strerror(err)));
  }
}

void PeerWatch::check_liveness() {
  const auto now = Clock::now();
  for (int q = 0; q < size_ && lost_ < 0 && rail_lost_.empty(); ++q) {
    check_rails(q, now);
    WatchPeer& p = peers_[q];
    if (p.live_fd < 0) continue;
    pollfd fd{p.live_fd, POLLOUT, 0};
    if (poll(&fd, 1, 0) <= 0) {
      if (now - p.live_since < kLiveTimeout) continue;
      ::close(std::exchange(p.live_fd, -1));
      if (hub_.user_ops_with(q))
        hub_.lose(q, fmt::format("its host did not answer a connection attempt for {} s",
                                 std::chrono::duration_cast<std::chrono::seconds>(kLiveTimeout).count()));
      continue;
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
}

void PeerWatch::send_notices() {
  notices_due_ = false;
  for (int64_t d = 1; d < size_; d *= 2) {
    const int q = static_cast<int>((rank_ + d) % size_);
    if (q == lost_ || q == lost_reporter_ || peers_[q].ring) continue;  // ring peers read the closed word
    notice_bytes_.push_back(encode_notice(lost_, lost_detail_));
    if (auto op = hub_.post_internal(Op::Role::kNotice, q, notice_bytes_.back().data(), notice_bytes_.back().size()))
      notices_.push_back(std::move(op));
  }
}

void PeerWatch::flush_notices() {
  if (closed_) return;
  if (notices_due_) send_notices();
  const auto until = Clock::now() + kNoticeFlush;
  for (;;) {
    notices_.remove_if([](const std::shared_ptr<Op>& op) { return op->done; });
    if (notices_.empty() || Clock::now() >= until) break;
    hub_.progress_now();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  notices_.clear();
}

void PeerWatch::close() {
  closed_ = true;
  watch_.clear();
  notices_.clear();
  for (auto& p : peers_) {
    if (p.live_fd >= 0) ::close(std::exchange(p.live_fd, -1));
    for (auto& rp : p.rail_probes)
      if (rp.fd >= 0) ::close(std::exchange(rp.fd, -1));
    p.ring = false;
  }
}

}  // namespace trn::fabric
