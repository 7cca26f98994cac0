// Prometheus metrics of the coordinator: RPC counts by method and code, RPC latency histograms,
// and gauges read from the Registry (jobs, members, generation, heartbeats, restarts, last
// committed step and its time, heartbeat age, heartbeat timeout), served as text at
// http://HOST:PORT/metrics by an embedded civetweb server.
#pragma once

#include <array>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "launcher/server/registry.h"

struct mg_context;  // civetweb

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

// Serves GET /metrics (everything else: 404) with civetweb: a pool of threads serves
// connections concurrently, and a connection that sends no complete request within the request
// timeout is closed, so idle or slow clients never hold up a scrape. A port already in use is a
// usage error. Stops in the destructor.
class MetricsHttpServer {
 public:
  MetricsHttpServer(const std::string& host_port, std::function<std::string()> page);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  int port() const { return port_; }
  std::string page() { return page_(); }

 private:
  ::mg_context* ctx_ = nullptr;
  int port_ = 0;
  std::function<std::string()> page_;
};

// A usage error naming flag when host:port cannot be bound by a new listener (in use, not a
// local address). Binds without SO_REUSEPORT, so a port another process listens on is refused
// even when that process shares it.
void check_port_free(const std::string& host, int port, const std::string& flag_value);

// Splits "HOST:PORT" ("[v6]:PORT" too); a usage error naming flag when malformed.
std::pair<std::string, int> parse_host_port(const std::string& s, const char* flag);

}  // namespace trn::control
