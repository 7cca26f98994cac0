#include "launcher/server/metrics.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::control {

void RpcMetrics::observe(const std::string& method, const char* code, double seconds) {
  std::lock_guard lock(mu_);
  counts_[{method, code}]++;
  auto& h = latency_[method];
  for (size_t i = 0; i < kBuckets.size(); ++i)
    if (seconds <= kBuckets[i]) h.buckets[i]++;
  h.count++;
  h.sum += seconds;
}

std::string RpcMetrics::render(const RegistryGauges& g) {
  std::string o;
  auto gauge = [&](const char* name, const char* help, int64_t v) {
    o += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{} {}\n", name, help, name, name, v);
  };
  gauge("trn_coordinator_jobs", "Jobs the coordinator holds.", g.jobs);
  gauge("trn_coordinator_members", "Member nodes of running generations, all jobs.", g.members);
  gauge("trn_coordinator_waiters", "Calls waiting (join, get, barrier).", g.waiters);
  o += fmt::format("# HELP trn_coordinator_heartbeats_total Heartbeats received.\n"
                   "# TYPE trn_coordinator_heartbeats_total counter\ntrn_coordinator_heartbeats_total {}\n",
                   g.heartbeats);
  o += "# HELP trn_job_generation Current generation of a job.\n# TYPE trn_job_generation gauge\n";
  for (const auto& j : g.per_job)
    o += fmt::format("trn_job_generation{{job=\"{}\",state=\"{}\"}} {}\n", j.job_id, j.state, j.generation);
  o += "# HELP trn_job_members Member nodes of a job's running generation.\n# TYPE trn_job_members gauge\n";
  for (const auto& j : g.per_job) o += fmt::format("trn_job_members{{job=\"{}\"}} {}\n", j.job_id, j.members);
  o += "# HELP trn_job_restarts_total Generations ended by failures or membership changes.\n"
       "# TYPE trn_job_restarts_total counter\n";
  for (const auto& j : g.per_job)
    o += fmt::format("trn_job_restarts_total{{job=\"{}\"}} {}\n", j.job_id, j.restarts);
  o += "# HELP trn_job_last_committed_step Last committed checkpoint step (-1: none).\n"
       "# TYPE trn_job_last_committed_step gauge\n";
  for (const auto& j : g.per_job)
    o += fmt::format("trn_job_last_committed_step{{job=\"{}\"}} {}\n", j.job_id, j.last_committed_step);
  std::lock_guard lock(mu_);
  o += "# HELP trn_coordinator_rpcs_total RPCs handled, by method and status code.\n"
       "# TYPE trn_coordinator_rpcs_total counter\n";
  for (const auto& [k, v] : counts_)
    o += fmt::format("trn_coordinator_rpcs_total{{method=\"{}\",code=\"{}\"}} {}\n", k.first, k.second, v);
  o += "# HELP trn_coordinator_rpc_seconds RPC latency (waiting calls include their wait).\n"
       "# TYPE trn_coordinator_rpc_seconds histogram\n";
  for (const auto& [m, h] : latency_) {
    for (size_t i = 0; i < kBuckets.size(); ++i)
      o += fmt::format("trn_coordinator_rpc_seconds_bucket{{method=\"{}\",le=\"{}\"}} {}\n", m, kBuckets[i],
                       h.buckets[i]);
    o += fmt::format("trn_coordinator_rpc_seconds_bucket{{method=\"{}\",le=\"+Inf\"}} {}\n", m, h.count);
    o += fmt::format("trn_coordinator_rpc_seconds_sum{{method=\"{}\"}} {}\n", m, h.sum);
    o += fmt::format("trn_coordinator_rpc_seconds_count{{method=\"{}\"}} {}\n", m, h.count);
  }
  return o;
}

std::pair<std::string, int> parse_host_port(const std::string& s, const char* flag) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos || colon + 1 == s.size())
    throw usage_error("{} {}: expected HOST:PORT (e.g. 127.0.0.1:0)", flag, s);
  std::string host = s.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  long port = std::strtol(s.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 0 || port > 65535)
    throw usage_error("{} {}: port must be a number from 0 to 65535", flag, s);
  return {host.empty() ? "0.0.0.0" : host, static_cast<int>(port)};
}

MetricsHttpServer::MetricsHttpServer(const std::string& host_port, std::function<std::string()> page)
    : page_(std::move(page)) {
  auto [host, port] = parse_host_port(host_port, "--metrics-listen");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw usage_error("--metrics-listen {}: cannot resolve {}", host_port, host);
  fd_ = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd_ < 0 || ::bind(fd_, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd_, 64) != 0) {
    int e = errno;
    freeaddrinfo(res);
    if (fd_ >= 0) ::close(fd_);
    throw usage_error("--metrics-listen {}: {}; pick a free port", host_port, std::strerror(e));
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  thread_ = std::thread([this] { serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) ::close(fd_);
}

void MetricsHttpServer::serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 200) <= 0) continue;
    int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) continue;
    std::string req;
    char buf[2048];
    for (int i = 0; i < 20 && req.find("\r\n\r\n") == std::string::npos && req.size() < 8192; ++i) {
      pollfd q{c, POLLIN, 0};
      if (::poll(&q, 1, 100) <= 0) continue;
      ssize_t n = ::recv(c, buf, sizeof buf, 0);
      if (n <= 0) break;
      req.append(buf, static_cast<size_t>(n));
    }
    std::string body, status = "200 OK", type = "text/plain; version=0.0.4";
    if (req.rfind("GET /metrics", 0) == 0) {
      body = page_();
    } else {
      status = "404 Not Found";
      type = "text/plain";
      body = "trn-coordinator serves GET /metrics\n";
    }
    std::string out = fmt::format("HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                                  status, type, body.size(), body);
    size_t off = 0;
    while (off < out.size()) {
      ssize_t n = ::send(c, out.data() + off, out.size() - off, MSG_NOSIGNAL);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(c);
  }
}

}  // namespace trn::control
