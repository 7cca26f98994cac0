#include "launcher/server/server.h"

#include <absl/synchronization/mutex.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "launcher/client/address.h"
#include "launcher/client/grpc_log.h"
#include "launcher/client/tls_files.h"
#include "launcher/server/datagram_server.h"
#include "launcher/server/metrics.h"
#include "launcher/server/registry.h"
#include "launcher/server/replica.h"
#include "launcher/server/service.h"
#include "launcher/server/state_dir.h"

namespace trn::control {

using log::Subsys;

std::string read_file_for_flag(const std::string& path, const char* flag) { return read_regular_file(path, flag); }

static std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

struct CoordinatorServer::Impl {
  ServerOptions opts;
  std::unique_ptr<StateDir> state;
  std::unique_ptr<Registry> registry;
  std::unique_ptr<Replica> replica;  // with --store; created once listening
  etcd::Options etcd;                // --etcd-tls-*: the files' PEM text, read before listening
  std::atomic<Replica*> active_replica{nullptr};  // replica, for gRPC's threads
  RpcMetrics metrics;
  std::unique_ptr<CoordinatorService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<DatagramServer> datagrams;  // reads into service: declared after it
  std::unique_ptr<MetricsHttpServer> http;
  int port = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::thread ticker;
  bool shut = false;

  void stop_ticker() {
    {
      std::lock_guard lock(mu);
      stopping = true;
    }
    cv.notify_all();
    if (ticker.joinable()) ticker.join();
  }
};

CoordinatorServer::CoordinatorServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  I.opts = std::move(options);
  route_grpc_logs();  // a client's refused TLS handshake is gRPC's error line, ours at debug
  // Everything the user named is checked before anything starts: one line, exit 2.
  const HostPort listen = parse_address(I.opts.listen, "--listen", PortUse::kListen);
  const std::string listen_host = listen.host.empty() ? "0.0.0.0" : listen.host;
  const int listen_port = listen.port;
  if (!I.opts.port_file.empty()) check_output_file(I.opts.port_file, "--port-file");
  if (!I.opts.metrics_listen.empty()) parse_address(I.opts.metrics_listen, "--metrics-listen", PortUse::kListen);
  if (!I.opts.store.empty() && !I.opts.state_dir.empty())
    throw usage_error("--store and --state-dir both keep the state; give one");
  if (!I.opts.store.empty() && !I.opts.advertise.empty()) parse_address(I.opts.advertise, "--advertise");
  if (I.opts.store.empty() &&
      !(I.opts.etcd_tls_ca.empty() && I.opts.etcd_tls_cert.empty() && I.opts.etcd_tls_key.empty()))
    throw usage_error("--etcd-tls-ca, --etcd-tls-cert and --etcd-tls-key go with --store etcd://...");
  if (I.opts.etcd_tls_ca.empty() && !(I.opts.etcd_tls_cert.empty() && I.opts.etcd_tls_key.empty()))
    throw usage_error("--etcd-tls-cert and --etcd-tls-key need --etcd-tls-ca, the CA that signed etcd's certificate");
  if (I.opts.etcd_tls_cert.empty() != I.opts.etcd_tls_key.empty())
    throw usage_error("--etcd-tls-cert and --etcd-tls-key go together");
  {
    // TLS is on because a flag was given: an empty or malformed file is an error, never plaintext.
    TlsPem etcd_pem = load_tls_files({I.opts.etcd_tls_ca, I.opts.etcd_tls_cert, I.opts.etcd_tls_key},
                                     {"--etcd-tls-ca", "--etcd-tls-cert", "--etcd-tls-key"});
    I.etcd.tls_ca = std::move(etcd_pem.ca);
    I.etcd.tls_cert = std::move(etcd_pem.cert);
    I.etcd.tls_key = std::move(etcd_pem.key);
  }
  // Standbys name the leader by its advertised address, which clients must hold verbatim.
  if (!I.opts.store.empty() && I.opts.advertise.empty() &&
      (listen_host == "0.0.0.0" || listen_host == "[::]" || listen_host == "::" || listen_host.empty()))
    throw usage_error("--store with --listen {} needs --advertise HOST:PORT: the address clients reach this "
                      "replica at (a wildcard address is no address for them)",
                      I.opts.listen);
  std::string token;
  if (!I.opts.token_file.empty()) {
    token = trim(read_file_for_flag(I.opts.token_file, "--token-file"));
    if (token.empty()) throw usage_error("--token-file {} is empty; put the bearer token in it", I.opts.token_file);
  }
  std::string read_token;
  if (!I.opts.read_token_file.empty()) {
    if (token.empty())
      throw usage_error(
          "--read-token-file needs --token-file: without an admin token every caller may write, so a "
          "read-only token would restrict nobody");
    read_token = trim(read_file_for_flag(I.opts.read_token_file, "--read-token-file"));
    if (read_token.empty())
      throw usage_error("--read-token-file {} is empty; put the read-only token in it",
                        I.opts.read_token_file);
    if (read_token == token)
      throw usage_error(
          "--read-token-file {} holds the admin token (--token-file); give the read-only token its own "
          "value",
          I.opts.read_token_file);
  }
  std::shared_ptr<grpc::ServerCredentials> creds;
  if (!I.opts.tls_cert.empty() || !I.opts.tls_key.empty()) {
    // Loaded and checked before listening: gRPC would take a bad certificate or a key of another
    // one and fail only in AddListeningPort, which reads as a port it cannot listen on.
    const TlsPem pem = load_tls_files({I.opts.tls_client_ca, I.opts.tls_cert, I.opts.tls_key},
                                      {"--tls-client-ca", "--tls-cert", "--tls-key"});
    grpc::SslServerCredentialsOptions ssl(I.opts.tls_client_ca.empty()
                                              ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                              : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_key_cert_pairs.push_back({pem.key, pem.cert});
    ssl.pem_root_certs = pem.ca;
    creds = grpc::SslServerCredentials(ssl);
  } else if (!I.opts.tls_client_ca.empty()) {
    throw usage_error("--tls-client-ca needs --tls-cert and --tls-key");
  } else {
    creds = grpc::InsecureServerCredentials();
  }
  RegistryOptions ro;
  ro.heartbeat_timeout = I.opts.heartbeat_timeout;
  ro.job_retention = I.opts.job_retention;
  ro.max_finished_jobs = I.opts.max_finished_jobs;
  ro.job_token_key = token;
  if (!I.opts.state_dir.empty()) {
    I.state = std::make_unique<StateDir>(I.opts.state_dir);
    StateDir* sd = I.state.get();
    ro.persist = [sd](const v1::LogRecord& rec) {
      try {
        sd->append(rec);
      } catch (const std::exception& e) {
        log::error(Subsys::kCoord, "saving state failed: {}", e.what());
      }
    };
  }
  if (!I.opts.store.empty()) {
    Impl* ip = impl_.get();
    ro.persist = [ip](const v1::LogRecord& rec) {
      if (Replica* r = ip->active_replica.load()) r->persist(rec);
    };
  }
  I.registry = std::make_unique<Registry>(ro);
  if (I.state) {
    auto snap = I.state->load();
    I.registry->restore(snap);
    log::info(Subsys::kCoord, "restored {} jobs from {}", snap.jobs_size(), I.state->path());
  }
  std::function<std::string()> refusal;
  if (!I.opts.store.empty()) {
    Impl* ip = impl_.get();
    // Until the replica exists (it needs the bound port) every call is refused as a standby's.
    refusal = [ip] {
      Replica* r = ip->active_replica.load();
      return r ? r->refusal() : std::string("standby coordinator; starting");
    };
  }
  I.service = std::make_unique<CoordinatorService>(*I.registry, I.metrics, token, read_token, refusal);

  // gRPC would share a port another server listens on (SO_REUSEPORT) and split the clients
  // between the two: check it is free, and tell gRPC not to share it.
  if (listen_port != 0) check_port_free(listen_host, listen_port, "--listen " + I.opts.listen);

  // The distribution's abseil checks every mutex for lock-order cycles (gRPC takes many per
  // call); that is a debugging aid, and a tenth of the coordinator's CPU under load.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(I.opts.listen, creds, &I.port);
  builder.RegisterService(I.service.get());
  builder.SetMaxReceiveMessageSize(I.opts.max_message_bytes);
  builder.SetMaxSendMessageSize(64 << 20);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  I.server = builder.BuildAndStart();
  if (!I.server || I.port == 0)
    throw usage_error("--listen {}: cannot listen there (port in use, or not a local address?); pick "
                      "another --listen",
                      I.opts.listen);
  // With TLS but no tokens the clients authenticate the coordinator and nothing else, and a
  // datagram without a token's MAC would be authenticated by nobody: gRPC only.
  const bool datagrams_unauthenticated = token.empty() && !I.opts.tls_cert.empty();
  if (datagrams_unauthenticated && !I.opts.no_heartbeat_datagrams)
    log::info(Subsys::kCoord, "TLS without --token-file: node heartbeats go over gRPC only (a datagram could not "
                              "be authenticated)");
  if (!I.opts.no_heartbeat_datagrams && !datagrams_unauthenticated) {
    // Best effort: without the UDP port (taken by another program) heartbeats use gRPC alone.
    try {
      CoordinatorService* svc = I.service.get();
      const int threads = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 4u));
      RpcMetrics* metrics = &I.metrics;
      I.datagrams = std::make_unique<DatagramServer>(
          listen_host, I.port, threads, [svc](std::string_view bytes) { return svc->heartbeat_datagram(bytes); },
          [metrics](const char* why, uint64_t n) { metrics->count("HeartbeatDatagram", why, n); });
      I.service->set_heartbeat_udp_port(I.datagrams->port());
    } catch (const std::exception& e) {
      log::warn(Subsys::kCoord, "{}; node heartbeats will use gRPC only", e.what());
    }
  }
  try {
    if (!I.opts.metrics_listen.empty()) {
      Impl* ip = impl_.get();
      I.http = std::make_unique<MetricsHttpServer>(
          I.opts.metrics_listen, [ip] { return ip->metrics.render(ip->registry->gauges()); });
    }
    if (!I.opts.store.empty()) {
      ReplicaOptions r;
      r.store = I.opts.store;
      r.prefix = I.opts.store_prefix;
      r.advertise = I.opts.advertise.empty() ? HostPort{listen_host, I.port, listen.ipv6}.str() : I.opts.advertise;
      r.lease_ttl_s = I.opts.leader_ttl_s;
      r.etcd = I.etcd;
      Registry* reg = I.registry.get();
      Replica::Hooks hooks;
      CoordinatorService* svc = I.service.get();
      hooks.elected = [reg, svc](const v1::Snapshot& snap) {
        reg->restore(snap);
        // The restored registry holds no datagram sequence numbers: datagrams of the epoch before
        // (replays included) are refused.
        svc->new_datagram_epoch();
        reg->reopen();
      };
      hooks.deposed = [reg](const std::string&) {
        reg->close();
        reg->restore(v1::Snapshot());  // what it held may be stale by the time it leads again
      };
      RpcMetrics* metrics = &I.metrics;
      metrics->serve_replica_metrics();
      hooks.refused_state = [metrics](const std::string&) { metrics->count_damaged_state_refusal(); };
      I.replica = std::make_unique<Replica>(r, hooks);
      I.active_replica = I.replica.get();
    }
    if (!I.opts.port_file.empty()) write_file_atomic(I.opts.port_file, std::to_string(I.port) + "\n");
  } catch (...) {
    I.datagrams.reset();
    if (I.replica) I.replica->stop();
    I.registry->close();
    I.server->Shutdown(std::chrono::system_clock::now());
    throw;
  }
  I.ticker = std::thread([ip = impl_.get()] {
    std::unique_lock lock(ip->mu);
    while (!ip->stopping) {
      lock.unlock();
      ip->registry->tick();
      lock.lock();
      ip->cv.wait_for(lock, std::chrono::milliseconds(25));
    }
  });
  log::info(Subsys::kCoord, "trn-coordinator listening on port {} ({}{}{}{}{}), heartbeat timeout {:.1f} s",
            I.port, creds ? (I.opts.tls_cert.empty() ? "plaintext" : "TLS") : "",
            I.datagrams ? fmt::format(", node heartbeats also as UDP datagrams on port {} ({} KiB receive buffer)",
                                      I.datagrams->port(), I.datagrams->receive_buffer_bytes() / 1024)
                        : "",
            token.empty()        ? ""
            : read_token.empty() ? ", token required (admin or a job's)"
                                 : ", token required (admin, read-only or a job's)",
            I.state     ? ", state in " + I.opts.state_dir
            : I.replica ? fmt::format(", state in {} under {}, a replica: standby until elected",
                                      I.opts.store, I.opts.store_prefix)
                        : "",
            I.http ? fmt::format(", metrics on port {}", I.http->port()) : "",
            std::chrono::duration<double>(I.opts.heartbeat_timeout).count());
}

int CoordinatorServer::port() const { return impl_->port; }
int CoordinatorServer::metrics_port() const { return impl_->http ? impl_->http->port() : 0; }
int CoordinatorServer::heartbeat_udp_port() const { return impl_->datagrams ? impl_->datagrams->port() : 0; }

void CoordinatorServer::shutdown() {
  auto& I = *impl_;
  if (I.shut) return;
  I.shut = true;
  // A leader gives its lease back first: a standby takes over at once, and no election can
  // reopen this registry while it shuts down. Calls from then on are refused as a standby's.
  if (I.replica) I.replica->stop();
  I.registry->close();
  I.service->set_heartbeat_udp_port(0);
  I.datagrams.reset();
  I.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  I.stop_ticker();
  I.http.reset();
  if (I.state) {
    I.registry->flush();
    I.state->compact();
  }
  log::info(Subsys::kCoord, "trn-coordinator stopped");
}

CoordinatorServer::~CoordinatorServer() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    log::error(Subsys::kCoord, "shutdown: {}", e.what());
  }
}

}  // namespace trn::control
