#include "launcher/agent/heartbeat_relay.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/client/agent_channel.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::launch {

namespace v1 = ::trn::coordinator::v1;

HeartbeatRelay::HeartbeatRelay(std::string job_id, const std::string& run_dir) : job_id_(std::move(job_id)) {
  constexpr const char* kName = "/heartbeats.sock";
  auto fits = [&](const std::string& dir) { return dir.size() + std::strlen(kName) < sizeof(sockaddr_un::sun_path); };
  std::error_code ec;
  if (!run_dir.empty() && fits(run_dir)) {
    path_ = run_dir + kName;
  } else {
    // sun_path holds 107 bytes: a long $TMPDIR falls back to /tmp.
    for (const std::string& base : {std::filesystem::temp_directory_path(ec).string(), std::string("/tmp")}) {
      std::string tmpl = fmt::format("{}/trnrun-{}-XXXXXX", base, ::getpid());
      if (base.empty() || !fits(tmpl)) continue;
      if (!::mkdtemp(tmpl.data())) continue;  // made 0700
      own_dir_ = tmpl;
      break;
    }
    if (own_dir_.empty()) throw remote_error("no temporary folder with a path short enough for a Unix socket");
    path_ = own_dir_ + kName;
  }
  auto fail = [&](const char* what) {
    int e = errno;
    if (fd_ >= 0) ::close(fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    if (own_dir_.empty()) std::filesystem::remove(path_, ec);
    else std::filesystem::remove_all(own_dir_, ec);
    return remote_error("heartbeat socket {}: {}: {}", path_, what, std::strerror(e));
  };
  fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw fail("socket");
  sockaddr_un addr{};
  socklen_t len = 0;
  control::unix_address(path_, &addr, &len);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) throw fail("bind");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw fail("eventfd");
  thread_ = std::thread([this] { receive_loop(); });
}

HeartbeatRelay::~HeartbeatRelay() {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  thread_.join();
  ::close(fd_);
  ::close(wake_fd_);
  std::error_code ec;
  if (own_dir_.empty()) std::filesystem::remove(path_, ec);
  else std::filesystem::remove_all(own_dir_, ec);
}

void HeartbeatRelay::expect(int64_t generation, int first_rank, int count) {
  std::lock_guard lock(mu_);
  if (count != count_) {
    peers_.clear();
    resume_pending_.clear();
  } else if (first_rank != first_rank_) {
    std::map<int, Peer> moved;
    // A survivor's datagrams of the ended generation carry its old rank, which may now be another
    // local rank's: only the new generation's may move an address from here on.
    for (auto& [rank, peer] : peers_) {
      Peer p = peer;
      p.generation = generation;
      moved[rank - first_rank_ + first_rank] = p;
    }
    peers_ = std::move(moved);
    for (int& rank : resume_pending_) rank += first_rank - first_rank_;
  }
  generation_ = generation;
  first_rank_ = first_rank;
  count_ = count;
  ranks_.clear();
}

std::vector<control::ForwardedHeartbeat> HeartbeatRelay::take() {
  std::vector<control::ForwardedHeartbeat> out;
  std::lock_guard lock(mu_);
  auto now = Clock::now();
  for (auto& [rank, r] : ranks_) {
    if (r.beats == 0) continue;
    out.push_back({r.progress, now - r.heard, r.beats});
    r.beats = 0;
  }
  return out;
}

bool HeartbeatRelay::send_to(int rank, const std::string& bytes, const char* what) {
  auto it = peers_.find(rank);
  if (it == peers_.end() || it->second.from_len == 0) return false;
  // Non-blocking: a worker whose queue is full, or that is gone, just misses this one.
  if (::sendto(fd_, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL,
               reinterpret_cast<const sockaddr*>(&it->second.from), it->second.from_len) < 0) {
    log::debug(log::Subsys::kLaunch, "could not tell rank {} to {}: {}", rank, what, std::strerror(errno));
    return false;
  }
  return true;
}

void HeartbeatRelay::tell_abort(const std::string& reason, int64_t generation) {
  v1::HeartbeatResponse resp;
  resp.set_abort(true);
  resp.set_generation(generation);
  resp.set_reason(reason);
  std::string bytes = resp.SerializeAsString();
  std::lock_guard lock(mu_);
  std::vector<int> told;
  // A worker that cannot take it now still gets SIGTERM from the agent (or, in place, was
  // already told to abort the generation it is leaving).
  for (const auto& [rank, r] : ranks_) told.push_back(rank);
  if (resume_generation_ == generation_)
    for (int rank : resume_pending_)
      if (!ranks_.count(rank)) told.push_back(rank);
  for (int rank : told) send_to(rank, bytes, "abort");
}

int HeartbeatRelay::tell_resume(int64_t generation, const std::vector<int>& ranks, int world_size, int node_rank) {
  std::lock_guard lock(mu_);
  resume_generation_ = generation;
  resume_bytes_.clear();
  resume_pending_.clear();
  int sent = 0;
  for (int rank : ranks) {
    if (rank < first_rank_ || rank >= first_rank_ + count_) continue;  // not this node's
    // Already heard in generation: it resumed (or was told by an earlier call).
    if (generation == generation_ && ranks_.count(rank)) continue;
    v1::HeartbeatResponse resp;
    resp.set_abort(false);
    resp.set_generation(generation);
    resp.set_reason(kResumeReason);
    resp.set_rank(rank);
    resp.set_world_size(world_size);
    resp.set_node_rank(node_rank);
    resume_bytes_[rank] = resp.SerializeAsString();
    resume_pending_.push_back(rank);
    sent += send_to(rank, resume_bytes_[rank], "resume");
  }
  return sent;
}

int HeartbeatRelay::resend_resume() {
  std::lock_guard lock(mu_);
  for (int rank : resume_pending_) send_to(rank, resume_bytes_[rank], "resume");
  return static_cast<int>(resume_pending_.size());
}

std::vector<int> HeartbeatRelay::resume_pending() const {
  std::lock_guard lock(mu_);
  return resume_pending_;
}

std::optional<Duration> HeartbeatRelay::silent_for(int rank) const {
  std::lock_guard lock(mu_);
  auto it = peers_.find(rank);
  if (it == peers_.end()) return std::nullopt;
  return Clock::now() - it->second.heard;
}

void HeartbeatRelay::receive_loop() {
  std::vector<char> buf(control::kMaxAgentDatagram);
  while (true) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    int n = ::poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      log::error(log::Subsys::kLaunch, "heartbeat socket poll failed: {}; workers' heartbeats stop here",
                 std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    while (true) {  // everything queued
      sockaddr_un from{};
      socklen_t from_len = sizeof from;
      ssize_t got = ::recvfrom(fd_, buf.data(), buf.size(), MSG_DONTWAIT | MSG_TRUNC,
                               reinterpret_cast<sockaddr*>(&from), &from_len);
      if (got < 0) break;  // EAGAIN (or EINTR: poll again)
      if (static_cast<size_t>(got) > buf.size()) {
        ++ignored_;
        continue;
      }
      handle(buf.data(), static_cast<size_t>(got), from, from_len);
    }
  }
}

void HeartbeatRelay::handle(const char* data, size_t size, const sockaddr_un& from, socklen_t from_len) {
  auto now = Clock::now();
  v1::HeartbeatRequest req;
  std::lock_guard lock(mu_);
  bool ours = req.ParseFromArray(data, static_cast<int>(size)) && req.kind() == v1::HeartbeatRequest::WORKER &&
              req.job_id() == job_id_ && req.rank() >= first_rank_ && req.rank() < first_rank_ + count_;
  if (ours) {
    // Any generation: a survivor heartbeats in the one it is leaving until it resumes.
    auto& peer = peers_[req.rank()];
    peer.heard = now;
    if (req.generation() >= peer.generation) {
      peer.generation = req.generation();
      peer.from = from;
      peer.from_len = from_len;
    }
  }
  if (!ours || req.generation() != generation_) {
    // A worker of an ended generation still stopping, or something else on the socket.
    if (++ignored_ == 1)
      log::debug(log::Subsys::kLaunch, "ignored a heartbeat datagram (job '{}' generation {} rank {})", req.job_id(),
                 req.generation(), req.rank());
    return;
  }
  if (resume_generation_ == generation_)
    std::erase(resume_pending_, static_cast<int>(req.rank()));
  auto& r = ranks_[req.rank()];
  auto& p = r.progress;
  p.rank = req.rank();
  p.host = req.host();
  p.pid = req.pid();
  p.step = req.step();
  p.loss = req.loss();
  p.tokens_per_s = req.tokens_per_s();
  if (req.has_coordinates())
    p.coordinates = control::GridCoordinates{req.coordinates().dp_rank(), req.coordinates().tp_rank(),
                                             req.coordinates().pp_rank()};
  else
    p.coordinates.reset();
  if (req.has_val_loss())
    p.val_loss = req.val_loss();
  else
    p.val_loss.reset();
  if (req.has_recovery())
    p.recovery = control::recovery_from_proto(req.recovery());
  else
    p.recovery.reset();
  r.heard = now;
  r.beats++;
}

}  // namespace trn::launch
