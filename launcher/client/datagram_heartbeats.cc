#include "launcher/client/datagram_heartbeats.h"

#include <netdb.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "collectives/core/log.h"
#include "launcher/client/heartbeat_datagram.h"

namespace trn::control {

using log::Subsys;

DatagramHeartbeats::DatagramHeartbeats() {
  // Sequence numbers start at the wall clock in microseconds, so an agent started anew on the same
  // node (same job, generation and node rank) starts past the numbers its predecessor used.
  seq_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

DatagramHeartbeats::~DatagramHeartbeats() {
  if (fd_ >= 0) ::close(fd_);
}

void DatagramHeartbeats::configure(const std::string& job_id, const std::string& key,
                                   const std::string& grpc_address, int udp_port, uint64_t epoch) {
  std::lock_guard lock(mu_);
  configure_locked(job_id, key, grpc_address, udp_port, epoch);
}

void DatagramHeartbeats::follow(const std::string& job_id, const std::string& grpc_address, int udp_port,
                                uint64_t epoch) {
  std::lock_guard lock(mu_);
  if (job_id == job_id_) configure_locked(job_id, std::string(key_), grpc_address, udp_port, epoch);
}

void DatagramHeartbeats::configure_locked(const std::string& job_id, const std::string& key,
                                          const std::string& grpc_address, int udp_port, uint64_t epoch) {
  if (job_id != job_id_ || key != key_ || epoch != epoch_) misses_ = skip_ = 0;
  job_id_ = job_id;
  key_ = key;
  epoch_ = epoch;
  if (udp_port <= 0 || udp_port > 65535) {
    to_len_ = 0;
    return;
  }
  auto colon = grpc_address.rfind(':');
  std::string host = colon == std::string::npos ? grpc_address : grpc_address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string target = fmt::format("{}:{}", host, udp_port);
  if (to_len_ > 0 && target == target_ && !resolve_again_) return;
  resolve_again_ = false;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), std::to_string(udp_port).c_str(), &hints, &res); rc != 0 || !res) {
    log::debug(Subsys::kCoord, "heartbeat datagrams: cannot resolve {}: {}; heartbeats go over gRPC", host,
               gai_strerror(rc));
    to_len_ = 0;
    return;
  }
  const int family = res->ai_family;
  std::memcpy(&to_, res->ai_addr, res->ai_addrlen);
  to_len_ = res->ai_addrlen;
  freeaddrinfo(res);
  if (fd_ >= 0) {
    sockaddr_storage own{};
    socklen_t len = sizeof own;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&own), &len) != 0 || own.ss_family != family) {
      ::close(fd_);
      fd_ = -1;
    }
  }
  if (fd_ < 0) fd_ = ::socket(family, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd_ < 0) {
    log::debug(Subsys::kCoord, "heartbeat datagrams: no socket: {}; heartbeats go over gRPC",
               std::strerror(errno));
    to_len_ = 0;
    return;
  }
  log::debug(Subsys::kCoord, "heartbeat datagrams of job '{}' go to {}", job_id, target);
  target_ = target;
  misses_ = skip_ = 0;
}

std::string DatagramHeartbeats::padded_payload(const coordinator::v1::HeartbeatRequest& req, bool keyed) {
  static_assert(kMinUnkeyedRequest > kDatagramHeader && kMinUnkeyedRequest < 16384,
                "the padding's length must fit a 2-byte varint");
  std::string payload = req.SerializeAsString();
  const size_t want = kMinUnkeyedRequest - kDatagramHeader;
  if (keyed || payload.size() >= want) return payload;
  // Field 15 (padding), length-delimited: one tag byte, the length as a varint (1 byte below 128,
  // 2 from there: want < 16384), the bytes. At least `room` bytes are added, one more at most.
  const size_t room = want - payload.size();
  size_t len = room > 2 ? room - 2 : 0;
  if (len >= 128) len = std::max<size_t>(128, room - 3);
  const auto tag = static_cast<char>((coordinator::v1::HeartbeatRequest::kPaddingFieldNumber << 3) | 2);
  payload += tag;
  if (len >= 128) {
    payload += static_cast<char>(0x80 | (len & 0x7f));
    payload += static_cast<char>(len >> 7);
  } else {
    payload += static_cast<char>(len);
  }
  payload.append(len, '\0');
  return payload;
}

std::optional<coordinator::v1::HeartbeatResponse> DatagramHeartbeats::exchange(
    const coordinator::v1::HeartbeatRequest& req, Duration wait, uint64_t* sent) {
  std::lock_guard lock(mu_);
  if (sent) *sent = 0;
  if (to_len_ == 0 || req.job_id() != job_id_) return std::nullopt;
  if (skip_ > 0) {
    --skip_;
    return std::nullopt;
  }
  const uint64_t seq = ++seq_;
  auto bytes = encode_datagram(DatagramType::kRequest, seq, epoch_, padded_payload(req, !key_.empty()), key_);
  if (!bytes) return std::nullopt;  // too large for a datagram: gRPC carries it
  const std::string request_mac(mac_of(*bytes, !key_.empty()));
  std::array<char, kMaxDatagram + 1> buf;
  while (::recv(fd_, buf.data(), buf.size(), MSG_DONTWAIT) >= 0) {
  }  // answers that came too late for their heartbeat
  auto miss = [&](const char* why) -> std::optional<coordinator::v1::HeartbeatResponse> {
    if (++misses_ >= kMissesToBackOff) {
      misses_ = 0;
      skip_ = kBackOffCalls;
      resolve_again_ = true;
      if (!backing_off_logged_)
        log::warn(
            Subsys::kCoord,
            "heartbeat datagrams to {} get no answer ({}); node heartbeats go over gRPC, and datagrams are "
            "tried again every {} heartbeats",
            target_, why, kBackOffCalls);
      backing_off_logged_ = true;
    }
    return std::nullopt;
  };
  if (::sendto(fd_, bytes->data(), bytes->size(), 0, reinterpret_cast<const sockaddr*>(&to_), to_len_) < 0)
    return miss(std::strerror(errno));
  if (sent) *sent = seq;
  const auto until = Clock::now() + wait;
  for (;;) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return miss("none within the wait");
    pollfd p{fd_, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno != EINTR) return miss(std::strerror(errno));
    if (n <= 0) continue;
    ssize_t got = ::recv(fd_, buf.data(), buf.size(), MSG_DONTWAIT);
    if (got < 0) continue;
    auto d = parse_datagram(std::string_view(buf.data(), static_cast<size_t>(got)), nullptr);
    // Anything else on the socket (a late answer, a forgery) is skipped.
    if (!d || d->type != DatagramType::kReply || d->seq != seq || !datagram_mac_ok(*d, key_, request_mac))
      continue;
    coordinator::v1::HeartbeatResponse resp;
    if (!resp.ParseFromArray(d->payload.data(), static_cast<int>(d->payload.size()))) continue;
    misses_ = 0;
    if (backing_off_logged_) {
      log::info(Subsys::kCoord, "heartbeat datagrams to {} are answered again", target_);
      backing_off_logged_ = false;
    }
    return resp;
  }
}

}  // namespace trn::control
