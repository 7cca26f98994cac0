#include "launcher/server/metrics.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <civetweb.h>

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
  o += "# HELP trn_job_last_committed_timestamp_seconds Unix time the last checkpoint committed (jobs with one).\n"
       "# TYPE trn_job_last_committed_timestamp_seconds gauge\n";
  for (const auto& j : g.per_job)
    if (j.last_committed_unix_ms > 0)
      o += fmt::format("trn_job_last_committed_timestamp_seconds{{job=\"{}\"}} {:.3f}\n", j.job_id,
                       j.last_committed_unix_ms / 1000.0);
  // The longest heartbeat silence among a running job's member nodes; at the heartbeat timeout
  // (trn_coordinator_heartbeat_timeout_seconds) the coordinator ends the generation.
  o += "# HELP trn_job_heartbeat_age_seconds Seconds since the longest-silent member node of a running job "
       "last heartbeated.\n# TYPE trn_job_heartbeat_age_seconds gauge\n";
  for (const auto& j : g.per_job)
    if (j.heartbeat_age_s >= 0)
      o += fmt::format("trn_job_heartbeat_age_seconds{{job=\"{}\"}} {:.3f}\n", j.job_id, j.heartbeat_age_s);
  o += fmt::format("# HELP trn_coordinator_heartbeat_timeout_seconds Silence that ends a member's generation.\n"
                   "# TYPE trn_coordinator_heartbeat_timeout_seconds gauge\n"
                   "trn_coordinator_heartbeat_timeout_seconds {}\n",
                   g.heartbeat_timeout_s);
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

void check_port_free(const std::string& host, int port, const std::string& flag_value) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw usage_error("{}: cannot resolve {}", flag_value, host);
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int e = 0;
  if (fd < 0 || ::bind(fd, res->ai_addr, res->ai_addrlen) != 0) e = errno;
  freeaddrinfo(res);
  if (fd >= 0) ::close(fd);
  if (e == EADDRINUSE)
    throw usage_error("{}: port {} is in use (another trn-coordinator?); pick a free port", flag_value, port);
  if (e != 0) throw usage_error("{}: cannot listen there: {}", flag_value, std::strerror(e));
}

namespace {

int serve_request(mg_connection* conn, void* cbdata) {
  auto* self = static_cast<MetricsHttpServer*>(cbdata);
  const mg_request_info* ri = mg_get_request_info(conn);
  std::string uri = ri && ri->local_uri ? ri->local_uri : "";
  std::string method = ri && ri->request_method ? ri->request_method : "";
  int status = 200;
  std::string body, reason = "OK", type = "text/plain; version=0.0.4";
  if (uri == "/metrics" && (method == "GET" || method == "HEAD")) {
    body = self->page();
  } else {
    status = 404;
    reason = "Not Found";
    type = "text/plain";
    body = "trn-coordinator serves GET /metrics\n";
  }
  std::string head = fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                 status, reason, type, body.size());
  mg_write(conn, head.data(), head.size());
  if (method != "HEAD") mg_write(conn, body.data(), body.size());
  return status;
}

int quiet_log(const mg_connection*, const char* message) {
  log::debug(log::Subsys::kCoord, "metrics http: {}", message);
  return 1;  // handled: civetweb prints nothing itself
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(const std::string& host_port, std::function<std::string()> page)
    : page_(std::move(page)) {
  static const unsigned init = mg_init_library(0);
  (void)init;
  const std::string flag_value = "--metrics-listen " + host_port;
  auto [host, port] = parse_host_port(host_port, "--metrics-listen");
  check_port_free(host, port, flag_value);
  // civetweb takes numeric addresses only ("1.2.3.4:P", "[::1]:P").
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res)
    throw usage_error("{}: cannot resolve {}", flag_value, host);
  char num[INET6_ADDRSTRLEN] = {};
  bool v6 = res->ai_family == AF_INET6;
  getnameinfo(res->ai_addr, res->ai_addrlen, num, sizeof num, nullptr, 0, NI_NUMERICHOST);
  freeaddrinfo(res);
  std::string ports = v6 ? fmt::format("[{}]:{}", num, port) : fmt::format("{}:{}", num, port);
  // Threads serve one connection each; a connection silent for the request timeout is dropped.
  const char* options[] = {"listening_ports", ports.c_str(),      "num_threads",           "16",
                           "request_timeout_ms", "5000",          "enable_keep_alive",     "no",
                           "max_request_size",   "16384",         nullptr};
  mg_callbacks callbacks{};
  callbacks.log_message = quiet_log;
  mg_init_data init_data{};
  init_data.callbacks = &callbacks;
  init_data.user_data = this;
  init_data.configuration_options = options;
  char err[256] = {};
  unsigned code = 0;
  mg_error_data error{&code, err, sizeof err};
  ctx_ = mg_start2(&init_data, &error);
  if (!ctx_) throw usage_error("{}: cannot serve metrics there: {}", flag_value, err[0] ? err : "civetweb failed to start");
  mg_set_request_handler(ctx_, "/", serve_request, this);
  mg_server_port sp[4] = {};
  int n = mg_get_server_ports(ctx_, 4, sp);
  port_ = n > 0 ? sp[0].port : port;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (ctx_) mg_stop(ctx_);
}

}  // namespace trn::control
