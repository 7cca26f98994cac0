// trn-coordinator: the control plane of trn jobs (rendezvous, key-value store, heartbeats,
// generations, checkpoint registry, status). Runs until SIGTERM or SIGINT.
#include <signal.h>

#include <cstdio>
#include <string>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "launcher/server/server.h"

namespace {

const char* kUsage =
    "usage: trn-coordinator [--listen HOST:PORT] [--port-file FILE] [--state-dir DIR]\n"
    "                       [--token-file FILE] [--tls-cert PEM --tls-key PEM [--tls-client-ca PEM]]\n"
    "                       [--metrics-listen HOST:PORT] [--heartbeat-timeout SECONDS]\n"
    "                       [--max-message-bytes N] [--job-retention S] [--max-finished-jobs N]\n"
    "\n"
    "  --listen HOST:PORT         gRPC address (default 127.0.0.1:0; port 0 picks a free port)\n"
    "  --port-file FILE           write the bound port to FILE (atomically) once listening\n"
    "  --state-dir DIR            keep jobs, generations and committed checkpoints in DIR so they\n"
    "                             survive a restart (default: memory only)\n"
    "  --token-file FILE          require 'authorization: Bearer <token>' with the token in FILE\n"
    "  --tls-cert/--tls-key PEM   serve TLS; with --tls-client-ca also require client certificates\n"
    "  --metrics-listen HOST:PORT Prometheus text at http://HOST:PORT/metrics\n"
    "  --heartbeat-timeout S      a member silent this long ends its generation (default 30)\n"
    "  --job-retention S          finished jobs (completed, failed, abandoned) are removed S seconds\n"
    "                             after they finished (default 3600)\n"
    "  --max-finished-jobs N      keep at most N finished jobs, removing the oldest (default 1000)\n"
    "  --max-message-bytes N      largest request accepted (default 4194304)\n";

double parse_seconds(const std::string& v, const char* flag) {
  char* end = nullptr;
  double s = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(s > 0) || s > 86400)
    throw trn::usage_error("{} {}: expected seconds, more than 0 and at most 86400", flag, v);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-coordinator", [&] {
    trn::control::ServerOptions o;
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "-h" || a == "--help") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw trn::usage_error("{} needs a value (see --help)", a);
        return argv[++i];
      };
      if (a == "--listen") o.listen = value();
      else if (a == "--port-file") o.port_file = value();
      else if (a == "--state-dir") o.state_dir = value();
      else if (a == "--token-file") o.token_file = value();
      else if (a == "--tls-cert") o.tls_cert = value();
      else if (a == "--tls-key") o.tls_key = value();
      else if (a == "--tls-client-ca") o.tls_client_ca = value();
      else if (a == "--metrics-listen") o.metrics_listen = value();
      else if (a == "--heartbeat-timeout")
        o.heartbeat_timeout = std::chrono::duration_cast<trn::Duration>(
            std::chrono::duration<double>(parse_seconds(value(), "--heartbeat-timeout")));
      else if (a == "--job-retention") {
        std::string v = value();
        char* end = nullptr;
        double sec = std::strtod(v.c_str(), &end);
        if (v.empty() || *end != '\0' || !(sec >= 0) || sec > 366.0 * 86400)
          throw trn::usage_error("--job-retention {}: expected seconds, from 0 to 31622400 (366 days)", v);
        o.job_retention = std::chrono::duration_cast<trn::Duration>(std::chrono::duration<double>(sec));
      } else if (a == "--max-finished-jobs") {
        std::string v = value();
        char* end = nullptr;
        long n = std::strtol(v.c_str(), &end, 10);
        if (v.empty() || *end != '\0' || n < 0 || n > 1000000)
          throw trn::usage_error("--max-finished-jobs {}: expected a count from 0 to 1000000", v);
        o.max_finished_jobs = static_cast<size_t>(n);
      } else if (a == "--max-message-bytes") {
        std::string v = value();
        char* end = nullptr;
        long n = std::strtol(v.c_str(), &end, 10);
        if (*end != '\0' || n < 4096 || n > (64 << 20))
          throw trn::usage_error("--max-message-bytes {}: expected 4096..67108864", v);
        o.max_message_bytes = static_cast<int>(n);
      } else {
        throw trn::usage_error("unknown argument '{}' (see --help)", a);
      }
    }
    // Signals are taken by sigwait below; every thread started from here inherits the mask.
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    signal(SIGPIPE, SIG_IGN);
    trn::control::CoordinatorServer server(o);
    int sig = 0;
    sigwait(&set, &sig);
    trn::log::info(trn::log::Subsys::kCoord, "signal {}: shutting down", sig);
    server.shutdown();
    return 0;
  });
}
