// trn-coordinator: the control plane of trn jobs (rendezvous, key-value store, heartbeats,
// generations, checkpoint registry, status). Runs until SIGTERM or SIGINT.
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "launcher/server/server.h"

namespace {

// The flags, setting the members of *o; --help renders the defaults from *o.
trn::flags::Table table(trn::control::ServerOptions* o) {
  using trn::flags::Range;
  return {
      .program = "trn-coordinator",
      .summary = "The control plane of trn jobs: rendezvous, key-value store, heartbeats, generations,\n"
                 "checkpoint registry and status. Runs until SIGTERM or SIGINT.\n",
      .flags =
          {
              {"--listen", &o->listen, "gRPC address (port 0 picks a free port)", "", "HOST:PORT"},
              {"--port-file", &o->port_file, "write the bound port to FILE (atomically) once listening", "", "FILE"},
              {"--state-dir", &o->state_dir,
               "keep jobs, generations and committed checkpoints in DIR so they survive a restart", "", "DIR",
               "memory only"},
              {"--store", &o->store,
               "keep the state in etcd (etcd://HOST:PORT[,HOST:PORT...]), as one of several replicas: one is "
               "elected leader, the others answer as standbys and take over when it fails",
               "", "URL"},
              {"--store-prefix", &o->store_prefix, "with --store: the etcd keys of this coordinator's state", "",
               "PREFIX"},
              {"--advertise", &o->advertise, "with --store: the address clients reach this replica at", "",
               "HOST:PORT", "the --listen address"},
              {.name = "--leader-ttl", .target = &o->leader_ttl_s,
               .help = "with --store: seconds the leader's lease lasts; a standby takes over this long after the "
                       "leader fails (etcd raises it to its minimum)",
               .value_name = "S", .range = Range::kMinMax, .min = 1, .max = 3600,
               .invalid = "expected whole seconds, 1..3600"},
              {"--etcd-tls-ca", &o->etcd_tls_ca,
               "with --store: speak TLS to etcd, verifying its members' certificates against this CA", "", "PEM"},
              {"--etcd-tls-cert", &o->etcd_tls_cert,
               "with --etcd-tls-ca: present this client certificate to etcd (and --etcd-tls-key)", "", "PEM"},
              {"--etcd-tls-key", &o->etcd_tls_key, "the etcd client certificate's key", "", "PEM"},
              {"--token-file", &o->token_file,
               "require 'authorization: Bearer <token>': the admin token in FILE (every call), or a "
               "job's token (handed out in join replies; calls on that job only)",
               "", "FILE"},
              {"--read-token-file", &o->read_token_file,
               "with --token-file: also accept the read-only token in FILE (status and events only)", "",
               "FILE"},
              {"--tls-cert", &o->tls_cert, "serve TLS with this certificate (and --tls-key)", "", "PEM"},
              {"--tls-key", &o->tls_key, "the TLS certificate's key", "", "PEM"},
              {"--tls-client-ca", &o->tls_client_ca, "with --tls-cert: also require client certificates from this CA",
               "", "PEM"},
              {"--metrics-listen", &o->metrics_listen, "Prometheus text at http://HOST:PORT/metrics", "", "HOST:PORT"},
              {.name = "--heartbeat-timeout", .target = &o->heartbeat_timeout,
               .help = "a member silent this long ends its generation", .range = Range::kPositiveAtMost,
               .max = 86400, .invalid = "expected seconds, more than 0 and at most 86400"},
              {.name = "--job-retention", .target = &o->job_retention,
               .help = "finished jobs (completed, failed, abandoned) are removed S seconds after they finished",
               .range = Range::kMinMax, .min = 0, .max = 366.0 * 86400,
               .invalid = "expected seconds, from 0 to 31622400 (366 days)"},
              {.name = "--max-finished-jobs", .target = &o->max_finished_jobs,
               .help = "keep at most N finished jobs, removing the oldest", .range = Range::kMinMax, .min = 0,
               .max = 1000000, .invalid = "expected a count from 0 to 1000000"},
              {.name = "--no-heartbeat-datagrams", .target = &o->no_heartbeat_datagrams,
               .help = "take node heartbeats over gRPC only, not also as UDP datagrams on the --listen port "
                       "number"},
              {.name = "--max-message-bytes", .target = &o->max_message_bytes, .help = "largest request accepted",
               .range = Range::kMinMax, .min = 4096, .max = 64 << 20, .invalid = "expected 4096..67108864"},
          },
      .style = trn::flags::Style::kColon,
  };
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-coordinator", [&] {
    trn::control::ServerOptions o;
    if (!trn::flags::parse(table(&o), std::vector<std::string>(argv + 1, argv + argc))) return 0;
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
