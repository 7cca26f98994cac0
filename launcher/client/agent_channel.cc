#include "launcher/client/agent_channel.h"

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "collectives/core/error.h"
#include "launcher/client/grpc_log.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;

bool unix_address(const std::string& path, sockaddr_un* addr, socklen_t* len) {
  *addr = sockaddr_un{};
  addr->sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr->sun_path)) return false;
  std::memcpy(addr->sun_path, path.data(), path.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + 1);
  return true;
}

std::string encode_worker_heartbeat(const std::string& job_id, int64_t generation,
                                    const WorkerProgress& progress) {
  return worker_heartbeat_request(job_id, generation, progress).SerializeAsString();
}

std::optional<WorkerHeartbeat> decode_worker_heartbeat(const char* data, size_t size) {
  v1::HeartbeatRequest req;
  if (size > kMaxAgentDatagram || !req.ParseFromArray(data, static_cast<int>(size)) ||
      req.kind() != v1::HeartbeatRequest::WORKER || req.rank() < 0)
    return std::nullopt;
  WorkerHeartbeat h;
  h.job_id = req.job_id();
  h.generation = req.generation();
  auto& p = h.progress;
  p.rank = req.rank();
  p.host = req.host();
  p.pid = req.pid();
  p.step = req.step();
  p.loss = req.loss();
  p.tokens_per_s = req.tokens_per_s();
  if (req.has_coordinates()) {
    const auto& c = req.coordinates();
    if (c.dp_rank() < 0 || c.tp_rank() < 0 || c.pp_rank() < 0) return std::nullopt;
    p.coordinates = GridCoordinates{c.dp_rank(), c.tp_rank(), c.pp_rank()};
  }
  if (req.has_val_loss()) p.val_loss = req.val_loss();
  if (req.has_recovery()) p.recovery = recovery_from_proto(req.recovery());
  if (req.has_moe()) p.moe = moe_from_proto(req.moe());
  return h;
}

std::string encode_agent_abort(const std::string& reason, int64_t generation) {
  v1::HeartbeatResponse resp;
  resp.set_abort(true);
  resp.set_generation(generation);
  resp.set_reason(reason);
  return resp.SerializeAsString();
}

std::string encode_agent_resume(const Resume& r) {
  v1::HeartbeatResponse resp;
  resp.set_abort(false);
  resp.set_generation(r.generation);
  resp.set_reason(kResumeReason);
  resp.set_rank(r.rank);
  resp.set_world_size(r.world_size);
  resp.set_node_rank(r.node_rank);
  return resp.SerializeAsString();
}

std::optional<AgentAnswer> decode_agent_answer(const char* data, size_t size) {
  v1::HeartbeatResponse resp;
  if (size > kMaxAgentDatagram || !resp.ParseFromArray(data, static_cast<int>(size))) return std::nullopt;
  AgentAnswer a;
  if (resp.abort()) {
    a.abort = true;
    a.reason = resp.reason().empty() ? "the job's generation moved on" : resp.reason();
    return a;
  }
  a.resume = Resume{resp.generation(), resp.rank(), resp.world_size(), resp.node_rank()};
  const Resume& r = a.resume;
  // world_size 0: the rank is unchanged, and rank and node rank are not read.
  if (r.generation < 0 || r.world_size < 0 ||
      (r.world_size > 0 &&
       (r.rank < 0 || r.rank >= r.world_size || r.node_rank < 0 || r.node_rank >= r.world_size)))
    return std::nullopt;
  return a;
}

AgentChannel::AgentChannel(std::string agent_path) : path_(std::move(agent_path)) {
  route_grpc_logs();  // an answer protobuf refuses is dropped here, not a line of the log each
  if (!unix_address(path_, &addr_, &addr_len_))
    throw remote_error("{}={} is not a usable socket path (empty, or longer than {} bytes)", kAgentSocketEnv, path_,
                       sizeof(addr_.sun_path) - 1);
  fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw remote_error("cannot open a socket to the trnrun agent: {}", std::strerror(errno));
  // Autobind: the kernel gives the socket a unique abstract address, which is where the agent's
  // answers (abort) come back to.
  sockaddr_un self{};
  self.sun_family = AF_UNIX;
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&self), sizeof(sa_family_t)) != 0) {
    int e = errno;
    ::close(fd_);
    throw remote_error("cannot bind a socket to hear the trnrun agent: {}", std::strerror(e));
  }
}

AgentChannel::~AgentChannel() {
  if (fd_ >= 0) ::close(fd_);
}

AgentChannel::Sent AgentChannel::send(const std::string& job_id, int64_t generation, const WorkerProgress& p) {
  const std::string bytes = encode_worker_heartbeat(job_id, generation, p);
  while (true) {
    ssize_t n = ::sendto(fd_, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL,
                         reinterpret_cast<const sockaddr*>(&addr_), addr_len_);
    if (n >= 0) return Sent::kOk;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) return Sent::kBusy;
    error_ = std::strerror(errno);
    return Sent::kGone;
  }
}

std::optional<std::string> AgentChannel::receive() {
  std::vector<char> buf(kMaxAgentDatagram);
  std::optional<std::string> abort;
  while (true) {
    sockaddr_un from{};
    socklen_t from_len = sizeof from;
    ssize_t n = ::recvfrom(fd_, buf.data(), buf.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &from_len);
    if (n < 0) {
      if (errno == EINTR) continue;
      return abort;  // EAGAIN: nothing more waiting
    }
    // Only the agent's own socket may tell this worker to stop.
    if (from_len <= offsetof(sockaddr_un, sun_path) || from.sun_path[0] == '\0' ||
        std::strncmp(from.sun_path, path_.c_str(), sizeof from.sun_path) != 0)
      continue;
    const auto answer = decode_agent_answer(buf.data(), static_cast<size_t>(n));
    if (!answer) continue;
    if (!answer->abort) {
      if (!resume_ || resume_->generation < answer->resume.generation) resume_ = answer->resume;
      continue;
    }
    abort = answer->reason;
  }
}

std::optional<Resume> AgentChannel::take_resume() { return std::exchange(resume_, std::nullopt); }

}  // namespace trn::control
