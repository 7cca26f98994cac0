// Small helpers the coordinator's integration tests share: client options for a test
// coordinator, a one-node join request, and raw loopback TCP (free ports, HTTP GET).
#pragma once

#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "launcher/client/coordinator_client.h"
#include "tests/integration/coordinator/coordinator_process.h"

namespace trn::test {

inline control::ClientOptions client_options(const CoordinatorProcess& c,
                                             std::chrono::seconds rpc_timeout = std::chrono::seconds(20),
                                             const std::string& token = "") {
  control::ClientOptions o;
  o.address = c.address();
  o.rpc_timeout = rpc_timeout;
  o.token = token;
  return o;
}

// A one-node job's join (node "n0" on host "h").
inline control::JoinRequest single_node(const std::string& job, int nproc = 1,
                                        std::chrono::seconds timeout = std::chrono::seconds(20)) {
  control::JoinRequest r;
  r.job_id = job;
  r.node_id = "n0";
  r.host = "h";
  r.nproc_per_node = nproc;
  r.deadline = Deadline::after(timeout);
  return r;
}

// A loopback port that was free a moment ago.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

inline int connect_loopback(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

// GET path over HTTP/1.1; gives up on a reply that does not come within `within`.
inline std::string http_get(int port, const std::string& path, std::chrono::seconds within = std::chrono::seconds(5)) {
  int fd = connect_loopback(port);
  timeval tv{static_cast<time_t>(within.count()), 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string req = fmt::format("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", path);
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return out;
}

}  // namespace trn::test
