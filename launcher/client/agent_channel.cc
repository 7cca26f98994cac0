#include "launcher/client/agent_channel.h"

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>
#include <vector>

#include "collectives/core/error.h"
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

AgentChannel::AgentChannel(std::string agent_path) : path_(std::move(agent_path)) {
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
  const std::string bytes = worker_heartbeat_request(job_id, generation, p).SerializeAsString();
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
    v1::HeartbeatResponse resp;
    if (!resp.ParseFromArray(buf.data(), static_cast<int>(n))) continue;
    if (!resp.abort()) {
      if (!resume_ || resume_->generation < resp.generation())
        resume_ = Resume{resp.generation(), resp.rank(), resp.world_size(), resp.node_rank()};
      continue;
    }
    abort = resp.reason().empty() ? "the job's generation moved on" : resp.reason();
  }
}

std::optional<Resume> AgentChannel::take_resume() { return std::exchange(resume_, std::nullopt); }

}  // namespace trn::control
