// trn-coordinator assembled: the Registry, its --state-dir, the gRPC server (coordinator
// service, health checking, reflection; optional TLS and bearer tokens), the metrics endpoint
// and the ticker that drives deadlines and heartbeat timeouts.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "collectives/core/deadline.h"

namespace trn::control {

struct ServerOptions {
  std::string listen = "127.0.0.1:0";
  std::string port_file;       // written atomically with the bound port once listening
  std::string state_dir;       // empty: state lives in memory only (or in etcd, with store)
  // etcd://HOST:PORT[,...]: keep the state in etcd, as one of several replicas electing a leader
  // (launcher/server/replica.h); the others answer as standbys.
  std::string store;
  std::string store_prefix = "/trn/coordinator/";
  std::string advertise;  // with store: HOST:PORT clients reach this replica at (default: --listen)
  int64_t leader_ttl_s = 2;
  std::string etcd_tls_ca, etcd_tls_cert, etcd_tls_key;  // with store: paths of PEM files
  std::string token_file;       // the admin token; empty: no authentication
  std::string read_token_file;  // the read-only token (GetStatus, WatchEvents); needs token_file
  std::string tls_cert, tls_key, tls_client_ca;
  std::string metrics_listen;  // empty: no metrics endpoint
  Duration heartbeat_timeout = std::chrono::seconds(30);
  Duration job_retention = std::chrono::hours(1);  // finished jobs are removed after this
  size_t max_finished_jobs = 1000;                 // and beyond this many, the oldest first
  int max_message_bytes = 4 << 20;
  // Node heartbeats over gRPC only. Without it they are also taken as UDP datagrams, on the
  // --listen host and port number (launcher/server/datagram_server.h).
  bool no_heartbeat_datagrams = false;
};

class CoordinatorServer {
 public:
  // Listening when this returns. Every bad path or address is a usage error thrown before
  // anything starts.
  explicit CoordinatorServer(ServerOptions options);
  ~CoordinatorServer();                               // shuts down (see shutdown())
  int port() const;
  int metrics_port() const;
  int heartbeat_udp_port() const;  // 0: no heartbeat datagrams
  // Stops accepting calls, ends waiting calls, saves a last snapshot. Idempotent.
  void shutdown();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Reads a whole file (a token, a certificate); a usage error naming flag when it cannot.
std::string read_file_for_flag(const std::string& path, const char* flag);

}  // namespace trn::control
