// Prometheus metrics of the coordinator: RPC counts by method and code, RPC latency histograms,
// and gauges read from the Registry (jobs, members, generation, heartbeats, restarts, last
// committed step and its time, heartbeat age, heartbeat timeout, validation loss, in-place
// recoveries, steps lost and goodput), a replica's refusals to lead on a damaged state, served as text at
// http://HOST:PORT/metrics by a small event-driven HTTP/1.1 server.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "launcher/server/registry.h"

namespace trn::control {

class RpcMetrics {
 public:
  static constexpr std::array<double, 14> kBuckets = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                      0.1,    0.25,  0.5,    1,     2.5,   5,     10};
  void observe(const std::string& method, const char* code, double seconds);
  // n more calls of method ended with code, with no latency to record (datagrams lost unread).
  void count(const std::string& method, const char* code, uint64_t n);
  // A replica (--store) serves trn_coordinator_damaged_state_refusals_total from now on.
  void serve_replica_metrics() { replica_ = true; }
  // A replica won the leader key but refused to lead on a damaged state in etcd (Replica::Hooks).
  void count_damaged_state_refusal() { damaged_state_refusals_.fetch_add(1, std::memory_order_relaxed); }
  // The whole /metrics page.
  std::string render(const RegistryGauges& gauges);

 private:
  struct Hist {
    std::array<uint64_t, kBuckets.size()> buckets{};
    uint64_t count = 0;
    double sum = 0;
  };
  std::mutex mu_;
  std::map<std::pair<std::string, std::string>, uint64_t> counts_;  // (method, code)
  std::map<std::string, Hist> latency_;
  std::atomic<bool> replica_{false};
  std::atomic<uint64_t> damaged_state_refusals_{0};
};

// Serves GET and HEAD /metrics (every other path: 404) over HTTP/1.1, one response per
// connection (Connection: close). One thread multiplexes every connection with poll() on
// non-blocking sockets, so no client can hold up another: a connection must deliver its whole
// request (at most kMaxRequestBytes) within kRequestTimeoutMs of being accepted and take the whole
// response within kResponseTimeoutMs, or it is closed. At most kMaxConnections are open at once;
// beyond that (or when the process runs out of file descriptors) the oldest connection still
// waiting for its request is closed to make room, so a flood of idle sockets cannot lock a
// scraper out. A port already in use is a usage error. Stops in the destructor.
class MetricsHttpServer {
 public:
  static constexpr int kRequestTimeoutMs = 5000;
  static constexpr int kResponseTimeoutMs = 10000;
  static constexpr size_t kMaxRequestBytes = 16384;
  static constexpr size_t kMaxConnections = 512;

  MetricsHttpServer(const std::string& host_port, std::function<std::string()> page);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  int port() const { return port_; }

 private:
  void run();

  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: the destructor's stop signal to run()
  int port_ = 0;
  std::function<std::string()> page_;
  std::thread thread_;
};

// A usage error naming flag when host:port cannot be bound by a new listener (in use, not a
// local address). Binds without SO_REUSEPORT, so a port another process listens on is refused
// even when that process shares it.
void check_port_free(const std::string& host, int port, const std::string& flag_value);

// Splits "HOST:PORT" ("[v6]:PORT" too); a usage error naming flag when malformed.
std::pair<std::string, int> parse_host_port(const std::string& s, const char* flag);

}  // namespace trn::control
