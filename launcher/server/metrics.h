// Prometheus metrics of the coordinator: RPC counts by method and code, RPC latency histograms,
// and gauges read from the Registry (jobs, members, generation, heartbeats, restarts, last
// committed step), served as text at http://HOST:PORT/metrics by a small HTTP server.
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
};

// Serves GET /metrics on a TCP socket from one thread; stops in the destructor.
class MetricsHttpServer {
 public:
  MetricsHttpServer(const std::string& host_port, std::function<std::string()> page);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  void serve();
  int fd_ = -1;
  int port_ = 0;
  std::function<std::string()> page_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Splits "HOST:PORT" ("[v6]:PORT" too); a usage error naming flag when malformed.
std::pair<std::string, int> parse_host_port(const std::string& s, const char* flag);

}  // namespace trn::control
