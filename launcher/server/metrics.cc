#include "launcher/server/metrics.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/client/address.h"

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

void RpcMetrics::count(const std::string& method, const char* code, uint64_t n) {
  std::lock_guard lock(mu_);
  counts_[{method, code}] += n;
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
  o += "# HELP trn_job_val_loss Validation loss rank 0 of a job last reported (jobs with one).\n"
       "# TYPE trn_job_val_loss gauge\n";
  for (const auto& j : g.per_job)
    if (j.val_loss) o += fmt::format("trn_job_val_loss{{job=\"{}\"}} {:.9g}\n", j.job_id, *j.val_loss);
  // In-place recoveries, per job (never per rank), from rank 0's newest report. A family is
  // served once it has a sample: one without any would only be noise (and is never ingested).
  // The totals are counters as the reporter counts them: a new run (or rank 0 starting anew)
  // starts them over, which rate() and increase() take as a counter reset.
  auto family = [&](const char* name, const char* type, const char* help, auto value) {
    std::string samples;
    for (const auto& j : g.per_job)
      if (j.recovery)
        if (std::optional<std::string> v = value(*j.recovery))
          samples += fmt::format("{}{{job=\"{}\"}} {}\n", name, j.job_id, *v);
    if (!samples.empty()) o += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}", name, help, name, type, samples);
  };
  using Value = std::optional<std::string>;
  family("trn_job_recoveries_total", "counter", "In-place recoveries of a job's run (rank 0's report).",
         [](const v1::RecoveryStatus& r) -> Value { return std::to_string(r.recoveries()); });
  family("trn_job_last_recovery_seconds", "gauge",
         "Seconds from a failure being seen to the first step after a job's newest in-place recovery.",
         [](const v1::RecoveryStatus& r) -> Value {
           if (r.recoveries() == 0) return std::nullopt;
           return fmt::format("{:.9g}", r.detect_to_first_step_s());
         });
  family("trn_job_steps_lost_total", "counter", "Steps run again after the in-place recoveries of a job's run.",
         [](const v1::RecoveryStatus& r) -> Value { return std::to_string(r.steps_lost_total()); });
  family("trn_job_goodput_ratio", "gauge",
         "Seconds of kept steps over wall seconds since a job's run started (rank 0's report).",
         [](const v1::RecoveryStatus& r) -> Value {
           if (!r.has_goodput()) return std::nullopt;
           return fmt::format("{:.9g}", r.goodput());
         });
  // Expert balance of a mixture-of-experts job, from rank 0's newest step (every rank computes the
  // same global figures). Served only for jobs that reported one: a dense model has no series, and
  // with no MoE job at all the families are not on the page.
  auto moe_family = [&](const char* name, const char* help, auto samples_of) {
    std::string samples;
    for (const auto& j : g.per_job)
      if (j.moe) samples += samples_of(j.job_id, *j.moe);
    if (!samples.empty()) o += fmt::format("# HELP {} {}\n# TYPE {} gauge\n{}", name, help, name, samples);
  };
  moe_family("trn_job_moe_aux_loss", "MoE balancing loss of a job's newest step (rank 0's report).",
             [](const std::string& job, const v1::MoeStatus& m) {
               return fmt::format("trn_job_moe_aux_loss{{job=\"{}\"}} {:.9g}\n", job, m.aux_loss());
             });
  moe_family("trn_job_moe_max_mean",
             "Per MoE layer, the busiest expert's tokens over the mean in a job's newest step (1: balanced).",
             [](const std::string& job, const v1::MoeStatus& m) {
               std::string s;
               for (int l = 0; l < m.max_mean_size(); ++l)
                 s += fmt::format("trn_job_moe_max_mean{{job=\"{}\",layer=\"{}\"}} {:.9g}\n", job, l, m.max_mean(l));
               return s;
             });
  moe_family("trn_job_moe_dead_experts", "Per MoE layer, the experts that took no token in a job's newest step.",
             [](const std::string& job, const v1::MoeStatus& m) {
               std::string s;
               for (int l = 0; l < m.dead_experts_size(); ++l)
                 s += fmt::format("trn_job_moe_dead_experts{{job=\"{}\",layer=\"{}\"}} {}\n", job, l,
                                  m.dead_experts(l));
               return s;
             });
  moe_family("trn_job_moe_dropped", "Expert choices the capacity dropped in a job's newest step, all layers.",
             [](const std::string& job, const v1::MoeStatus& m) {
               return fmt::format("trn_job_moe_dropped{{job=\"{}\"}} {:.0f}\n", job, m.dropped());
             });
  o += fmt::format("# HELP trn_coordinator_heartbeat_timeout_seconds Silence that ends a member's generation.\n"
                   "# TYPE trn_coordinator_heartbeat_timeout_seconds gauge\n"
                   "trn_coordinator_heartbeat_timeout_seconds {}\n",
                   g.heartbeat_timeout_s);
  if (replica_.load())
    o += fmt::format("# HELP trn_coordinator_damaged_state_refusals_total Times this replica won the leader key but "
                     "refused to lead, and so refused every call, because a record of the state in etcd is damaged.\n"
                     "# TYPE trn_coordinator_damaged_state_refusals_total counter\n"
                     "trn_coordinator_damaged_state_refusals_total {}\n",
                     damaged_state_refusals_.load(std::memory_order_relaxed));
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
  const HostPort hp = parse_address(s, flag, PortUse::kListen);  // the one address parser
  return {hp.host.empty() ? "0.0.0.0" : hp.host, hp.port};
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

using Clock = std::chrono::steady_clock;

// After the response is written the server half-closes and reads whatever the client still
// sends until it closes too, at most this long: closing with unread input would make the kernel
// send a reset that can discard the response before the client reads it.
constexpr auto kLinger = std::chrono::milliseconds(1000);
// accept() out of file descriptors with nothing to evict: stop accepting for this long.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

struct Conn {
  enum class State { kReading, kWriting, kLingering };
  int fd = -1;
  State state = State::kReading;
  Clock::time_point accepted;
  Clock::time_point deadline;  // closed when it passes, whatever the state
  std::string in;
  std::string out;
  size_t sent = 0;
};

std::string response(int status, const char* reason, const char* type, const std::string& body, bool head) {
  std::string r =
      fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                  status, reason, type, body.size());
  if (!head) r += body;
  return r;
}

std::string plain(int status, const char* reason, const std::string& body, bool head = false) {
  return response(status, reason, "text/plain", body, head);
}

// The path of a request target: origin form ("/metrics?x") or absolute form
// ("http://host/metrics"), without query or fragment, percent-decoded; empty when malformed.
std::string request_path(std::string target) {
  for (const char* scheme : {"http://", "https://"}) {
    if (target.rfind(scheme, 0) == 0) {
      auto slash = target.find('/', std::strlen(scheme));
      target = slash == std::string::npos ? "/" : target.substr(slash);
    }
  }
  target = target.substr(0, target.find_first_of("?#"));
  if (target.empty() || target[0] != '/') return "";
  std::string path;
  for (size_t i = 0; i < target.size(); ++i) {
    if (target[i] != '%') {
      path += target[i];
      continue;
    }
    if (i + 2 >= target.size() || !std::isxdigit(static_cast<unsigned char>(target[i + 1])) ||
        !std::isxdigit(static_cast<unsigned char>(target[i + 2])))
      return "";
    path += static_cast<char>(std::stoi(target.substr(i + 1, 2), nullptr, 16));
    i += 2;
  }
  return path;
}

// The whole response to the request head `head` (request line and headers, without the blank
// line that ends them).
std::string answer(const std::string& head, const std::function<std::string()>& page) {
  std::string line = head.substr(0, head.find('\n'));
  if (!line.empty() && line.back() == '\r') line.pop_back();
  std::vector<std::string> parts;
  for (size_t i = 0; i <= line.size();) {
    size_t sp = std::min(line.find(' ', i), line.size());
    parts.push_back(line.substr(i, sp - i));
    i = sp + 1;
  }
  if (parts.size() != 3 || parts[0].empty()) return plain(400, "Bad Request", "malformed request line\n");
  const std::string& method = parts[0];
  const std::string& version = parts[2];
  if (version != "HTTP/1.1" && version != "HTTP/1.0") {
    if (version.rfind("HTTP/", 0) == 0)
      return plain(505, "HTTP Version Not Supported", "trn-coordinator speaks HTTP/1.1\n");
    return plain(400, "Bad Request", "malformed request line\n");
  }
  std::string path = request_path(parts[1]);
  if (path.empty()) return plain(400, "Bad Request", "malformed request target\n");
  bool head_only = method == "HEAD";
  if (path == "/metrics" && (method == "GET" || head_only)) {
    try {
      return response(200, "OK", "text/plain; version=0.0.4", page(), head_only);
    } catch (const std::exception& e) {
      log::warn(log::Subsys::kCoord, "metrics http: rendering /metrics failed: {}", e.what());
      return plain(500, "Internal Server Error", "rendering the metrics failed\n", head_only);
    }
  }
  return plain(404, "Not Found", "trn-coordinator serves GET /metrics\n", head_only);
}

// The end of the request head in `in` (the index just past the blank line), or npos. Bare LF
// line ends are accepted too.
size_t head_end(const std::string& in) {
  for (size_t i = in.find('\n'); i != std::string::npos; i = in.find('\n', i + 1)) {
    if (i + 1 < in.size() && in[i + 1] == '\n') return i + 2;
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') return i + 3;
  }
  return std::string::npos;
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(const std::string& host_port, std::function<std::string()> page)
    : page_(std::move(page)) {
  const std::string flag_value = "--metrics-listen " + host_port;
  auto [host, port] = parse_host_port(host_port, "--metrics-listen");
  check_port_free(host, port, flag_value);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    throw usage_error("{}: cannot resolve {}", flag_value, host);
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int e = fd < 0 ? errno : 0;
  if (fd >= 0) {
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    // IPV6_V6ONLY is left at the system's default, as gRPC leaves it for --listen: on Linux
    // "[::]:P" takes IPv4 clients too.
    if (::bind(fd, res->ai_addr, res->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) e = errno;
  }
  freeaddrinfo(res);
  if (e != 0) {
    if (fd >= 0) ::close(fd);
    if (e == EADDRINUSE)
      throw usage_error("{}: port {} is in use (another trn-coordinator?); pick a free port", flag_value,
                        port);
    throw usage_error("{}: cannot serve metrics there: {}", flag_value, std::strerror(e));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  listen_fd_ = fd;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    e = errno;
    ::close(listen_fd_);
    throw Error(ErrorKind::kInternal, fmt::format("metrics http: eventfd: {}", std::strerror(e)));
  }
  thread_ = std::thread([this] { run(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  uint64_t one = 1;
  // Cannot fail: the counter is far from its limit. run() sees the eventfd readable and returns.
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  ::close(wake_fd_);
  ::close(listen_fd_);
}

// The event loop: level-triggered poll() over the stop signal, the listener and every
// connection; each connection moves reading -> writing -> lingering -> closed, and a passed
// deadline closes it in any state. Nothing here blocks but poll() itself.
void MetricsHttpServer::run() {
  std::vector<Conn> conns;
  std::vector<pollfd> fds;
  Clock::time_point accept_resume{};
  auto close_conn = [](Conn& c) {
    ::close(c.fd);
    c.fd = -1;
  };
  // Makes room by closing the connection that has waited longest for its request; false when
  // every connection is past its request (those finish within their own deadlines).
  auto evict_oldest_reader = [&conns, &close_conn] {
    Conn* oldest = nullptr;
    for (auto& c : conns)
      if (c.fd >= 0 && c.state == Conn::State::kReading && (!oldest || c.accepted < oldest->accepted))
        oldest = &c;
    if (!oldest) return false;
    close_conn(*oldest);
    return true;
  };
  auto start_writing = [](Conn& c, std::string out, Clock::time_point now) {
    c.out = std::move(out);
    c.in.clear();
    c.in.shrink_to_fit();
    c.state = Conn::State::kWriting;
    c.deadline = now + std::chrono::milliseconds(kResponseTimeoutMs);
  };
  auto on_readable = [&](Conn& c, Clock::time_point now) {
    char buf[4096];
    ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) return close_conn(c);                // the client closed or reset
    if (c.state == Conn::State::kLingering) return;  // discarded
    c.in.append(buf, static_cast<size_t>(n));
    size_t end = head_end(c.in);
    if (end == std::string::npos ? c.in.size() > kMaxRequestBytes : end > kMaxRequestBytes)
      start_writing(c, plain(431, "Request Header Fields Too Large", "request head too large\n"), now);
    else if (end != std::string::npos)
      start_writing(c, answer(c.in.substr(0, end), page_), now);
  };
  auto on_writable = [&close_conn](Conn& c, Clock::time_point now) {
    ssize_t n = ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n < 0) return close_conn(c);  // the client reset
    c.sent += static_cast<size_t>(n);
    if (c.sent < c.out.size()) return;
    c.out.clear();
    c.out.shrink_to_fit();
    ::shutdown(c.fd, SHUT_WR);
    c.state = Conn::State::kLingering;
    c.deadline = std::min(c.deadline, now + kLinger);
  };

  for (;;) {
    auto now = Clock::now();
    for (auto& c : conns)
      if (c.fd >= 0 && now >= c.deadline) close_conn(c);
    std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });

    bool accepting = now >= accept_resume;
    fds.assign({{wake_fd_, POLLIN, 0}, {accepting ? listen_fd_ : -1, POLLIN, 0}});
    auto wake_at = accepting ? Clock::time_point::max() : accept_resume;
    for (const auto& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.state == Conn::State::kWriting ? POLLOUT : POLLIN), 0});
      wake_at = std::min(wake_at, c.deadline);
    }
    int timeout_ms = -1;
    if (wake_at != Clock::time_point::max())
      timeout_ms = static_cast<int>(
          std::chrono::ceil<std::chrono::milliseconds>(std::max(wake_at - now, Clock::duration::zero()))
              .count());
    int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      log::error(log::Subsys::kCoord, "metrics http: poll failed: {}; /metrics is no longer served",
                 std::strerror(errno));
      break;
    }
    if (fds[0].revents) break;  // stop
    now = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      Conn& c = conns[i];
      short ev = fds[i + 2].revents;
      if (!ev) continue;
      if (c.state == Conn::State::kWriting) {
        if (ev & (POLLOUT | POLLERR | POLLHUP)) on_writable(c, now);
      } else {
        on_readable(c, now);
      }
      // A request answered at once is usually written in full right away.
      if (c.fd >= 0 && c.state == Conn::State::kWriting && c.sent == 0) on_writable(c, now);
    }
    if (fds[1].revents) {
      // Bounded, so a connect storm cannot starve the connections already open.
      for (int k = 0; k < 256; ++k) {
        int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            if (evict_oldest_reader()) {
              std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
              continue;
            }
            log::debug(log::Subsys::kCoord, "metrics http: accept: {}", std::strerror(errno));
            accept_resume = now + kAcceptPause;
          } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
            log::debug(log::Subsys::kCoord, "metrics http: accept: {}", std::strerror(errno));
            accept_resume = now + kAcceptPause;
          }
          break;
        }
        if (conns.size() >= kMaxConnections) {
          if (!evict_oldest_reader()) {
            ::close(fd);  // every slot is busy answering: this client retries
            continue;
          }
          std::erase_if(conns, [](const Conn& c) { return c.fd < 0; });
        }
        Conn c;
        c.fd = fd;
        c.accepted = now;
        c.deadline = now + std::chrono::milliseconds(kRequestTimeoutMs);
        conns.push_back(std::move(c));
      }
    }
  }
  for (auto& c : conns)
    if (c.fd >= 0) ::close(c.fd);
}

}  // namespace trn::control
