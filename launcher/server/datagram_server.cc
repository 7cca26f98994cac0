#include "launcher/server/datagram_server.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <memory>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/client/heartbeat_datagram.h"

namespace trn::control {

namespace {

constexpr int kBatch = 32;
constexpr int kReceiveBuffer = 8 << 20;

std::string bare_host(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

}  // namespace

DatagramServer::DatagramServer(const std::string& host, int port, int threads, Handler handler, Lost lost)
    : handler_(std::move(handler)), lost_(std::move(lost)) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string h = bare_host(host);
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(h.empty() ? nullptr : h.c_str(), service.c_str(), &hints, &res); rc != 0)
    throw remote_error("heartbeat datagrams: cannot resolve {}: {}", host, gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    // An IPv6 wildcard takes IPv4 too (as gRPC's does); an IPv4 one of the same name is then taken.
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0) {
      last_error = std::strerror(errno);
      ::close(fd);
      continue;
    }
    if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &kReceiveBuffer, sizeof kReceiveBuffer) != 0)
      (void)::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &kReceiveBuffer, sizeof kReceiveBuffer);
    const int one = 1;  // each datagram read carries the socket's drop count
    (void)::setsockopt(fd, SOL_SOCKET, SO_RXQ_OVFL, &one, sizeof one);
    fds_.push_back(fd);
  }
  freeaddrinfo(res);
  if (fds_.empty())
    throw remote_error("heartbeat datagrams: cannot bind UDP {}:{}: {}", host, port, last_error);
  kernel_drops_ = std::make_unique<std::atomic<uint32_t>[]>(fds_.size());
  socklen_t len = sizeof rcvbuf_;
  (void)::getsockopt(fds_[0], SOL_SOCKET, SO_RCVBUF, &rcvbuf_, &len);
  sockaddr_storage bound{};
  len = sizeof bound;
  if (::getsockname(fds_[0], reinterpret_cast<sockaddr*>(&bound), &len) == 0)
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  try {
    if (wake_fd_ < 0)
      throw internal_error("eventfd for the heartbeat datagram threads: {}", std::strerror(errno));
    for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { loop(); });
  } catch (...) {
    stop();
    throw;
  }
}

void DatagramServer::stop() {
  stop_ = true;
  uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof one);
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
  for (int fd : fds_) ::close(fd);
  fds_.clear();
}

DatagramServer::~DatagramServer() { stop(); }

void DatagramServer::kernel_dropped(size_t socket, uint32_t total) {
  std::atomic<uint32_t>& reported = kernel_drops_[socket];
  uint32_t before = reported.load(std::memory_order_relaxed);
  do {
    if (static_cast<int32_t>(total - before) <= 0) return;  // another reader reported as much
  } while (!reported.compare_exchange_weak(before, total, std::memory_order_relaxed));
  if (lost_) lost_(kReceiveBufferFull, total - before);
}

namespace {

// Room for one SO_RXQ_OVFL control message.
struct alignas(cmsghdr) Control {
  char bytes[CMSG_SPACE(sizeof(uint32_t))];
};

// One thread's buffers: each slot one datagram in, perhaps one answer out to where it came from.
struct Batch {
  std::vector<std::array<char, kMaxDatagram + 1>> in =
      std::vector<std::array<char, kMaxDatagram + 1>>(kBatch);
  std::array<sockaddr_storage, kBatch> from{};
  std::array<Control, kBatch> control{};
  std::array<iovec, kBatch> in_iov{};
  std::array<mmsghdr, kBatch> in_msgs{};
  std::array<std::string, kBatch> answer;
  std::array<iovec, kBatch> out_iov{};
  std::array<mmsghdr, kBatch> out_msgs{};

  // Reads what is waiting on fd (up to kBatch datagrams), answers it in one sendmmsg. Tells
  // kernel_drops the socket's drop count as the datagrams carry it, and unsent each answer lost.
  void serve(int fd, const DatagramServer::Handler& handler, const std::function<void(uint32_t)>& kernel_drops,
             const std::function<void()>& unsent) {
    for (int i = 0; i < kBatch; ++i) {
      in_iov[i] = {in[i].data(), in[i].size()};
      in_msgs[i] = {};
      in_msgs[i].msg_hdr.msg_iov = &in_iov[i];
      in_msgs[i].msg_hdr.msg_iovlen = 1;
      in_msgs[i].msg_hdr.msg_name = &from[i];
      in_msgs[i].msg_hdr.msg_namelen = sizeof from[i];
      in_msgs[i].msg_hdr.msg_control = control[i].bytes;
      in_msgs[i].msg_hdr.msg_controllen = sizeof control[i].bytes;
    }
    // Another thread may have emptied the socket first: then there is nothing to do.
    const int n = ::recvmmsg(fd, in_msgs.data(), kBatch, MSG_DONTWAIT, nullptr);
    if (n <= 0) return;
    int answers = 0;
    for (int i = 0; i < n; ++i) {
      auto& m = in_msgs[i];
      for (cmsghdr* c = CMSG_FIRSTHDR(&m.msg_hdr); c; c = CMSG_NXTHDR(&m.msg_hdr, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL) {
          uint32_t total;
          std::memcpy(&total, CMSG_DATA(c), sizeof total);
          kernel_drops(total);
        }
      // One longer than kMaxDatagram comes truncated (MSG_TRUNC) to the buffer's kMaxDatagram + 1
      // bytes: the handler drops it as too long, and counts it.
      auto a = handler(std::string_view(in[i].data(), m.msg_len));
      if (!a) continue;
      answer[answers] = std::move(*a);
      out_iov[answers] = {answer[answers].data(), answer[answers].size()};
      out_msgs[answers] = {};
      out_msgs[answers].msg_hdr.msg_iov = &out_iov[answers];
      out_msgs[answers].msg_hdr.msg_iovlen = 1;
      out_msgs[answers].msg_hdr.msg_name = &from[i];
      out_msgs[answers].msg_hdr.msg_namelen = m.msg_hdr.msg_namelen;
      ++answers;
    }
    // A full send buffer drops the rest: their senders fall back to gRPC.
    for (int sent = 0; sent < answers;) {
      const int k =
          ::sendmmsg(fd, out_msgs.data() + sent, static_cast<unsigned>(answers - sent), MSG_DONTWAIT);
      if (k > 0) {
        sent += k;
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
        log::debug(log::Subsys::kCoord, "heartbeat datagrams: an answer was not sent: {}",
                   std::strerror(errno));
      ++sent;  // skip the one that failed (an unreachable sender) and go on with the rest
      unsent();
    }
  }
};

}  // namespace

void DatagramServer::loop() {
  auto batch = std::make_unique<Batch>();
  auto unsent = [this] {
    if (lost_) lost_(kAnswerNotSent, 1);
  };
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) {
    log::error(log::Subsys::kCoord, "heartbeat datagrams: epoll_create1: {}; this thread reads none",
               std::strerror(errno));
    return;
  }
  epoll_event wake{};
  wake.events = EPOLLIN;
  wake.data.fd = wake_fd_;
  (void)::epoll_ctl(ep, EPOLL_CTL_ADD, wake_fd_, &wake);
  for (int fd : fds_) {
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLEXCLUSIVE;
    ev.data.fd = fd;
    (void)::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }
  while (!stop_) {
    epoll_event ready[4];
    const int k = ::epoll_wait(ep, ready, 4, -1);
    if (k < 0) {
      if (errno == EINTR) continue;
      log::error(log::Subsys::kCoord, "heartbeat datagrams: epoll_wait failed: {}; this thread reads no more",
                 std::strerror(errno));
      break;
    }
    if (stop_) break;
    for (int r = 0; r < k; ++r) {
      const int fd = ready[r].data.fd;
      if (fd == wake_fd_) continue;
      const size_t socket = static_cast<size_t>(std::find(fds_.begin(), fds_.end(), fd) - fds_.begin());
      batch->serve(fd, handler_, [this, socket](uint32_t total) { kernel_dropped(socket, total); }, unsent);
    }
  }
  ::close(ep);
}

}  // namespace trn::control
