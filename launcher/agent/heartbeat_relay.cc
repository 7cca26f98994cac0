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

namespace trn::launch {

bool HeartbeatTable::receive(const char* data, size_t size, const Address& from, Clock::time_point now) {
  auto beat = control::decode_worker_heartbeat(data, size);
  const bool ours = beat && beat->job_id == job_id_ && beat->progress.rank >= first_rank_ &&
                    beat->progress.rank < first_rank_ + count_;
  if (ours) {
    heartbeating_ = true;
    // Any generation: a survivor heartbeats in the one it is leaving until it resumes.
    auto& peer = peers_[beat->progress.rank];
    peer.heard = now;
    if (beat->generation >= peer.generation) {
      peer.generation = beat->generation;
      peer.from = from;
    }
  }
  if (!ours || beat->generation != generation_) {
    // A worker of an ended generation still stopping, or something else on the socket.
    if (++ignored_ == 1) {
      if (beat)
        log::debug(log::Subsys::kLaunch, "ignored a heartbeat datagram (job '{}' generation {} rank {})",
                   beat->job_id, beat->generation, beat->progress.rank);
      else
        log::debug(log::Subsys::kLaunch, "ignored a datagram of {} bytes that is no worker's heartbeat",
                   size);
    }
    return false;
  }
  const int rank = beat->progress.rank;
  if (resume_generation_ == generation_) std::erase(resume_pending_, rank);
  auto& r = ranks_[rank];
  r.progress = std::move(beat->progress);
  r.heard = now;
  r.beats++;
  return true;
}

void HeartbeatTable::expect(int64_t generation, int first_rank, int count) {
  if (count != count_) {
    peers_.clear();
    resume_pending_.clear();
    resume_bytes_.clear();
  } else if (first_rank != first_rank_) {
    // A survivor's datagrams of the ended generation carry its old rank, which may now be another
    // local rank's: only the new generation's may move an address from here on. What is owed to
    // a rank moves with it.
    std::map<int, Peer> moved;
    for (auto& [rank, peer] : peers_) {
      Peer p = peer;
      p.generation = generation;
      moved[rank - first_rank_ + first_rank] = p;
    }
    peers_ = std::move(moved);
    for (int& rank : resume_pending_) rank += first_rank - first_rank_;
    std::map<int, std::string> bytes;
    for (auto& [rank, b] : resume_bytes_) bytes[rank - first_rank_ + first_rank] = std::move(b);
    resume_bytes_ = std::move(bytes);
  }
  generation_ = generation;
  first_rank_ = first_rank;
  count_ = count;
  ranks_.clear();
  processes_.clear();  // the agent names each rank's process again (started())
}

void HeartbeatTable::started(int rank, int64_t pid, Clock::time_point at) {
  if (rank >= first_rank_ && rank < first_rank_ + count_) processes_[rank] = {pid, at};
}

std::vector<control::ForwardedHeartbeat> HeartbeatTable::take(Clock::time_point now) {
  std::vector<control::ForwardedHeartbeat> out;
  for (auto& [rank, r] : ranks_) {
    if (r.beats == 0) continue;
    out.push_back({r.progress, now - r.heard, r.beats});
    r.beats = 0;
  }
  if (!heartbeating_) return out;  // perhaps a program that never heartbeats: the node speaks for it
  for (const auto& [rank, proc] : processes_) {
    if (ranks_.count(rank)) continue;  // heard in this generation
    Clock::time_point alive = proc.at;
    if (auto p = peers_.find(rank); p != peers_.end()) alive = std::max(alive, p->second.heard);
    control::ForwardedHeartbeat f;
    f.progress.rank = rank;
    f.progress.pid = proc.pid;
    f.age = std::max(Duration::zero(), now - alive);
    f.beats = 0;
    f.silent = true;
    out.push_back(std::move(f));
  }
  return out;
}

std::optional<HeartbeatTable::Send> HeartbeatTable::send_to(int rank, std::string bytes) const {
  auto it = peers_.find(rank);
  if (it == peers_.end() || it->second.from.len == 0) return std::nullopt;
  return Send{rank, it->second.from, std::move(bytes)};
}

std::vector<HeartbeatTable::Send> HeartbeatTable::abort(const std::string& reason, int64_t generation) const {
  const std::string bytes = control::encode_agent_abort(reason, generation);
  std::vector<int> told;
  // A worker that cannot take it now still gets SIGTERM from the agent (or, in place, was
  // already told to abort the generation it is leaving).
  for (const auto& [rank, r] : ranks_) told.push_back(rank);
  if (resume_generation_ == generation_)
    for (int rank : resume_pending_)
      if (!ranks_.count(rank)) told.push_back(rank);
  std::vector<Send> out;
  for (int rank : told)
    if (auto s = send_to(rank, bytes)) out.push_back(std::move(*s));
  return out;
}

std::vector<HeartbeatTable::Send> HeartbeatTable::resume(int64_t generation, const std::vector<int>& ranks,
                                                         int world_size, int node_rank) {
  resume_generation_ = generation;
  resume_bytes_.clear();
  resume_pending_.clear();
  std::vector<Send> out;
  for (int rank : ranks) {
    if (rank < first_rank_ || rank >= first_rank_ + count_) continue;  // not this node's
    // Already heard in generation: it resumed (or was told by an earlier call).
    if (generation == generation_ && ranks_.count(rank)) continue;
    if (resume_bytes_.count(rank)) continue;  // named twice
    resume_bytes_[rank] = control::encode_agent_resume({generation, rank, world_size, node_rank});
    resume_pending_.push_back(rank);
    if (auto s = send_to(rank, resume_bytes_[rank])) out.push_back(std::move(*s));
  }
  return out;
}

std::vector<HeartbeatTable::Send> HeartbeatTable::resend_resume() const {
  std::vector<Send> out;
  for (int rank : resume_pending_) {
    auto bytes = resume_bytes_.find(rank);
    if (bytes == resume_bytes_.end()) continue;
    if (auto s = send_to(rank, bytes->second)) out.push_back(std::move(*s));
  }
  return out;
}

std::optional<Duration> HeartbeatTable::silent_for(int rank, Clock::time_point now) const {
  auto it = peers_.find(rank);
  if (it == peers_.end()) return std::nullopt;
  return now - it->second.heard;
}

HeartbeatRelay::HeartbeatRelay(std::string job_id, const std::string& run_dir) : table_(std::move(job_id)) {
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
  table_.expect(generation, first_rank, count);
}

void HeartbeatRelay::started(int rank, int64_t pid, Clock::time_point at) {
  std::lock_guard lock(mu_);
  table_.started(rank, pid, at);
}

void HeartbeatRelay::exited(int rank) {
  std::lock_guard lock(mu_);
  table_.exited(rank);
}

std::vector<control::ForwardedHeartbeat> HeartbeatRelay::take() {
  std::lock_guard lock(mu_);
  return table_.take(Clock::now());
}

bool HeartbeatRelay::send(const HeartbeatTable::Send& s, const char* what) {
  // Non-blocking: a worker whose queue is full, or that is gone, just misses this one.
  if (::sendto(fd_, s.bytes.data(), s.bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL,
               reinterpret_cast<const sockaddr*>(&s.to.addr), s.to.len) < 0) {
    log::debug(log::Subsys::kLaunch, "could not tell rank {} to {}: {}", s.rank, what, std::strerror(errno));
    return false;
  }
  return true;
}

void HeartbeatRelay::tell_abort(const std::string& reason, int64_t generation) {
  std::lock_guard lock(mu_);
  for (const auto& s : table_.abort(reason, generation)) send(s, "abort");
}

int HeartbeatRelay::tell_resume(int64_t generation, const std::vector<int>& ranks, int world_size, int node_rank) {
  std::lock_guard lock(mu_);
  int sent = 0;
  for (const auto& s : table_.resume(generation, ranks, world_size, node_rank)) sent += send(s, "resume");
  return sent;
}

int HeartbeatRelay::resend_resume() {
  std::lock_guard lock(mu_);
  for (const auto& s : table_.resend_resume()) send(s, "resume");
  return static_cast<int>(table_.resume_pending().size());
}

std::vector<int> HeartbeatRelay::resume_pending() const {
  std::lock_guard lock(mu_);
  return table_.resume_pending();
}

std::optional<Duration> HeartbeatRelay::silent_for(int rank) const {
  std::lock_guard lock(mu_);
  return table_.silent_for(rank, Clock::now());
}

int64_t HeartbeatRelay::ignored() const {
  std::lock_guard lock(mu_);
  return table_.ignored();
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
      HeartbeatTable::Address from;
      from.len = sizeof from.addr;
      ssize_t got = ::recvfrom(fd_, buf.data(), buf.size(), MSG_DONTWAIT | MSG_TRUNC,
                               reinterpret_cast<sockaddr*>(&from.addr), &from.len);
      if (got < 0) break;  // EAGAIN (or EINTR: poll again)
      const auto now = Clock::now();
      std::lock_guard lock(mu_);
      if (static_cast<size_t>(got) > buf.size())
        table_.ignore();
      else
        table_.receive(buf.data(), static_cast<size_t>(got), from, now);
    }
  }
}

}  // namespace trn::launch
