// trn-coordinator's /metrics server under hostile clients: idle sockets (held open and reopened
// whenever the server closes them), requests dribbled a byte at a time, clients that never read
// their response. Every scrape must still complete, with the whole page, within a hard deadline.
// Also the request forms it answers and refuses, and an IPv6 listen address.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "tests/integration/coordinator/helpers.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

using Clock = std::chrono::steady_clock;

// A non-blocking TCP socket connecting to 127.0.0.1:port (or [::1]:port); the connect may
// still be in progress. Throws on failure rather than asserting: IdleSockets calls it from a
// thread of its own, and Catch2's assertions belong to the test's thread.
int start_connect(int port, bool v6 = false) {
  int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket: {}", std::strerror(errno)));
  int rc;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    a.sin6_addr = in6addr_loopback;
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  }
  if (rc != 0 && errno != EINPROGRESS) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error(fmt::format("connect to port {}: {}", port, std::strerror(err)));
  }
  return fd;
}

// Sends `request` and reads the reply until the server closes, all within `within` from the
// connect on (a hard deadline: connecting, sending and reading included). The reply, or
// "TIMEOUT: " and what had arrived by the deadline, or "ERROR: ...".
std::string http_exchange(int port, const std::string& request, std::chrono::milliseconds within = 3000ms,
                          bool v6 = false) {
  auto deadline = Clock::now() + within;
  int fd = start_connect(port, v6);
  auto wait_for = [&](short events) {
    pollfd p{fd, events, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return left > 0 && ::poll(&p, 1, static_cast<int>(left)) == 1;
  };
  std::string out;
  auto finish = [&](const std::string& prefix) {
    ::close(fd);
    return prefix + out;
  };
  if (!wait_for(POLLOUT)) return finish("TIMEOUT: connecting; ");
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) return finish(fmt::format("ERROR: connect: {}; ", std::strerror(err)));
  for (size_t sent = 0; sent < request.size();) {
    if (!wait_for(POLLOUT)) return finish("TIMEOUT: sending; ");
    ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN) return finish(fmt::format("ERROR: send: {}; ", std::strerror(errno)));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  for (;;) {
    if (!wait_for(POLLIN)) return finish("TIMEOUT: reading; got: ");
    char buf[8192];
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0 && errno == EAGAIN) continue;
    if (n < 0) return finish(fmt::format("ERROR: recv: {}; got: ", std::strerror(errno)));
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

std::string get_request(const std::string& path) {
  return fmt::format("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", path);
}

// A whole 200 reply carrying the metrics page: its Content-Length matches the body received.
void check_full_page(const std::string& reply) {
  INFO(reply.substr(0, 2000));
  REQUIRE_THAT(reply, Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  auto end = reply.find("\r\n\r\n");
  REQUIRE(end != std::string::npos);
  std::string head = reply.substr(0, end);
  auto cl = head.find("Content-Length: ");
  REQUIRE(cl != std::string::npos);
  size_t length = std::stoul(head.substr(cl + 16));
  CHECK(reply.size() - end - 4 == length);
  CHECK_THAT(head, Catch::Contains("Content-Type: text/plain; version=0.0.4"));
  CHECK_THAT(reply, Catch::Contains("\ntrn_coordinator_jobs 0\n"));
  CHECK_THAT(reply, Catch::Contains("\n# TYPE trn_coordinator_rpc_seconds histogram\n"));
}

// Holds `n` connections to the port that never send a byte, on a thread of its own; one the
// server closes is reopened at once.
class IdleSockets {
 public:
  IdleSockets(int port, int n) : port_(port) {
    for (int i = 0; i < n; ++i) fds_.push_back(start_connect(port_));
    thread_ = std::thread([this] { hold(); });
  }
  ~IdleSockets() {
    stop_ = true;
    thread_.join();
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  int reopened() const { return reopened_; }
  int failed_reopens() const { return failed_; }

 private:
  void hold() {
    std::vector<pollfd> p(fds_.size());
    while (!stop_) {
      for (size_t i = 0; i < fds_.size(); ++i) p[i] = {fds_[i], POLLIN, 0};
      if (::poll(p.data(), p.size(), 50) <= 0) continue;
      for (size_t i = 0; i < fds_.size(); ++i) {
        if (!p[i].revents) continue;
        char c;
        ssize_t n = ::recv(fds_[i], &c, 1, 0);
        if (n < 0 && errno == EAGAIN) continue;
        // Closed (or reset, or refused) by the server: reconnect, and stay silent.
        ::close(fds_[i]);
        fds_[i] = -1;
        try {
          fds_[i] = start_connect(port_);
          reopened_++;
        } catch (const std::runtime_error&) {
          failed_++;  // the test asserts there were none, on its own thread
        }
      }
    }
  }
  int port_;
  std::vector<int> fds_;
  std::atomic<bool> stop_ = false;
  std::atomic<int> reopened_ = 0;
  std::atomic<int> failed_ = 0;
  std::thread thread_;
};

}  // namespace

TEST_CASE("/metrics answers every scrape while 200 idle sockets are held open and reopened") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  IdleSockets idle(mport, 200);
  // Scrapes spread over longer than the server's request timeout, so the idle sockets are
  // closed by the server and reopened while scrapes go on.
  auto until = Clock::now() + 7s;
  int scrapes = 0;
  while (Clock::now() < until || scrapes < 5) {
    INFO("scrape " << scrapes << ", idle sockets reopened so far: " << idle.reopened());
    check_full_page(http_exchange(mport, get_request("/metrics")));
    ++scrapes;
    std::this_thread::sleep_for(250ms);
  }
  // The server closed the silent ones rather than keep them forever.
  CHECK(idle.reopened() >= 200);
  CHECK(idle.failed_reopens() == 0);
  REQUIRE(coord.running());
}

TEST_CASE("/metrics answers scrapes while more idle sockets than its connection limit are held open") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  // Past the limit the oldest silent connection is closed for each new one; the holder reopens
  // it at once, so the server churns through silent sockets while the scrapes arrive.
  IdleSockets idle(mport, 700);
  for (int i = 0; i < 5; ++i) {
    INFO("scrape " << i << ", idle sockets reopened so far: " << idle.reopened());
    check_full_page(http_exchange(mport, get_request("/metrics")));
    std::this_thread::sleep_for(250ms);
  }
  CHECK(idle.reopened() > 0);
  CHECK(idle.failed_reopens() == 0);
  REQUIRE(coord.running());
}

TEST_CASE("slow-loris clients and clients that never read do not hold up /metrics, and are closed") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("127.0.0.1:{}", mport)});
  const std::string request = get_request("/metrics");
  // Clients that send a whole request and never read: each one's reply sits unread.
  std::vector<int> deaf;
  for (int i = 0; i < 50; ++i) {
    int fd = test::connect_loopback(mport);
    int small = 1024;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
    deaf.push_back(fd);
  }
  // Clients that send their request one byte at a time, each byte just before the last one
  // would go stale: they would take far longer than the request timeout to finish.
  std::vector<int> slow;
  for (int i = 0; i < 50; ++i) slow.push_back(test::connect_loopback(mport));
  std::vector<bool> closed(slow.size(), false);
  std::vector<std::string> got(slow.size());
  size_t next_byte = 0;
  auto hard_deadline = Clock::now() + 30s;
  int scrapes = 0;
  while (Clock::now() < hard_deadline && std::count(closed.begin(), closed.end(), false) > 0) {
    for (size_t i = 0; i < slow.size(); ++i) {
      if (closed[i]) continue;
      if (next_byte < request.size())
        if (::send(slow[i], &request[next_byte], 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EAGAIN)
          closed[i] = true;
      char buf[4096];
      ssize_t n;
      while ((n = ::recv(slow[i], buf, sizeof buf, MSG_DONTWAIT)) > 0)
        got[i].append(buf, static_cast<size_t>(n));
      if (n == 0 || (n < 0 && errno != EAGAIN)) closed[i] = true;
    }
    ++next_byte;
    INFO("scrape " << scrapes << " with slow clients at byte " << next_byte);
    check_full_page(http_exchange(mport, get_request("/metrics")));
    ++scrapes;
    std::this_thread::sleep_for(1s);
  }
  // The server gave up on every dribbling client before its request was complete, unanswered.
  CHECK(std::count(closed.begin(), closed.end(), true) == static_cast<long>(slow.size()));
  CHECK(next_byte < request.size());
  for (const auto& g : got) CHECK(g.empty());
  for (int fd : slow) ::close(fd);
  for (int fd : deaf) ::close(fd);
  REQUIRE(coord.running());
}

TEST_CASE("/metrics answers GET and HEAD, refuses malformed requests, and listens on [::1]") {
  test::TempDir dir;
  int mport = test::free_port();
  test::CoordinatorProcess coord(dir.path(), {"--metrics-listen", fmt::format("[::1]:{}", mport)});
  auto ask = [&](const std::string& req) { return http_exchange(mport, req, 3000ms, true); };
  check_full_page(ask(get_request("/metrics")));
  check_full_page(ask(get_request("/metrics?x=1")));
  check_full_page(ask(fmt::format("GET http://[::1]:{}/metrics HTTP/1.1\r\nHost: x\r\n\r\n", mport)));
  check_full_page(ask("GET /metrics HTTP/1.0\r\n\r\n"));
  // HEAD: the headers of GET, no body.
  auto head = ask("HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK_THAT(head, Catch::StartsWith("HTTP/1.1 200 OK\r\n") && Catch::EndsWith("\r\n\r\n"));
  CHECK_THAT(ask(get_request("/")), Catch::StartsWith("HTTP/1.1 404 Not Found\r\n") &&
                                        Catch::EndsWith("trn-coordinator serves GET /metrics\n"));
  CHECK_THAT(ask("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 404"));
  CHECK_THAT(ask("nonsense\r\n\r\n"), Catch::StartsWith("HTTP/1.1 400"));
  CHECK_THAT(ask("GET /metrics HTTP/2.0\r\n\r\n"), Catch::StartsWith("HTTP/1.1 505"));
  CHECK_THAT(ask("GET /metrics HTTP/1.1\r\nX: " + std::string(20000, 'a') + "\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 431"));
  // Only the address given: 127.0.0.1 is not ::1.
  CHECK_THAT(http_exchange(mport, get_request("/metrics")), Catch::StartsWith("ERROR: connect"));
  REQUIRE(coord.running());
}
