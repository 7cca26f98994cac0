// The peer watch (peer_watch.h): how it notices a lost peer and tells the other ranks.
//
// Why: over tcp (rxm) a receive is not tied to a connection, so when a peer dies the provider
// fails only the sends in flight to it. A rank waiting to receive from the dead rank, or from a
// live rank that itself waits for the dead one, would wait for its whole deadline. So:
//  - Probes (probes.h): a peer that a caller's operation is still waiting on at two probe ticks
//    in a row gets a connect to its liveness socket, which its kernel answers while the process
//    lives and refuses once it is gone.
//  - Notices: a rank that loses a peer sends "L<rank> <what happened>" to rank + 1, + 2, + 4, ...
//    (mod size, skipping the lost rank), and every rank that hears one loses that peer too and
//    forwards it the same way, so every rank hears it within log2(size) hops even if some of the
//    paths run through the dead rank. Same-host peers with rings hear it through the ring's
//    closed word instead (checked with the peers' pidfds).
//  - Every rank keeps one standing receive (kWatchBytes) for probes and notices from each peer
//    it reaches through an endpoint (not through rings).
// Ring peers on this host are watched through their pidfds instead.
#include <algorithm>
#include <thread>

#include "collectives/core/log.h"
#include "collectives/fabric/messages.h"
#include "collectives/fabric/tag.h"
#include "collectives/fabric/peer_watch.h"

namespace trn::fabric {
namespace {

// How long teardown lets notices go out before it closes the endpoints.
constexpr auto kNoticeFlush = std::chrono::milliseconds(300);
// How long a broken connection's peer stays a suspect before it is named the lost rank: a
// notice naming the rank that really died (sent by whoever found it) may still be on its way.
// A survivor that aborted on such a notice closes its connections, and on a loaded host a third
// rank saw that close 0.36 s before the notice and named the survivor; 1 s leaves the notices
// their time, and a broken connection costs one second more only when no notice ever comes.
constexpr auto kSuspectGrace = std::chrono::seconds(1);

}  // namespace

PeerWatch::PeerWatch(Hub& hub, int rank, int size, std::vector<WatchPeer> peers, Liveness liveness,
                     std::vector<std::string> rail_addresses, std::vector<std::string> rail_names)
    : hub_(hub), rank_(rank), size_(size),
      probes_(hub, rank, size, std::move(peers), liveness, std::move(rail_addresses)),
      rail_names_(std::move(rail_names)) {}

PeerWatch::~PeerWatch() { close(); }

void PeerWatch::start() {
  static_assert(kWatchBytes >= kNoticeBytes, "a notice fits the standing receive");
  watch_.resize(size_);
  watch_buf_.resize(size_);
  for (int q = 0; q < size_; ++q)
    if (q != rank_ && !probes_.ring(q)) post_watch(q);
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
  if (lost_ < 0 && rail_lost_.empty())
    if (std::optional<RailDown> down = probes_.check()) lose_rail(down->rail, down->detail);
  if (lost_ < 0) probes_.start();
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

void PeerWatch::send_notices() {
  notices_due_ = false;
  for (int64_t d = 1; d < size_; d *= 2) {
    const int q = static_cast<int>((rank_ + d) % size_);
    if (q == lost_ || q == lost_reporter_ || probes_.ring(q)) continue;  // ring peers read the closed word
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
  probes_.close();
}

}  // namespace trn::fabric
