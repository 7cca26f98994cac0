// trnctl: what a trn job is doing, from its coordinator.
//
// Exit codes (for scripts): 0 ok (status: every job shown is healthy, completed, or stopped by
// its user: a stop is intended, not a fault), 1 coordinator unreachable or another failure, 2
// usage error, 3 a job shown is unhealthy (a member late, stuck, dead or unknown, or the job
// forming or failed), 4 no such job.
#include <signal.h>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "collectives/core/settings.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "launcher/client/status_report.h"

using namespace trn;
using namespace trn::control;

namespace {

constexpr const char* kUsage =
    "[options] status [JOB]        jobs, members, health, progress, restarts\n"
    "       trnctl [options] watch [JOB]         live events (joins, failures, generations,\n"
    "                                            checkpoint commits) until interrupted\n"
    "       trnctl [options] checkpoints JOB     committed checkpoints of a job";

constexpr const char* kExitCodes =
    "exit codes: 0 ok (healthy, completed or stopped), 1 coordinator unreachable or failed, 2 usage,\n"
    "            3 job unhealthy (or forming, or failed), 4 no such job\n";

constexpr int kExitUnhealthy = 3;
constexpr int kExitNoJob = 4;

struct Args {
  ClientOptions client;
  std::string command, job;
  bool json = false, no_replay = false, ranks = false;
  int64_t count = -1;  // watch: events before exiting; -1: until interrupted
  HealthThresholds t;
  bool dead_set = false;
};

flags::Table table(Args* a, std::vector<std::string>* positional) {
  using flags::Range;
  constexpr const char* kPositive = "expected a positive number";
  return {
      .program = "trnctl",
      .summary = "",
      .flags =
          {
              {"--coordinator", &a->client.address, "coordinator address", "", "HOST:PORT", "TRN_COORDINATOR"},
              {"--token-file", [a](auto&, auto& v) { a->client.token = read_token_file(v); },
               "bearer token: the coordinator's admin or read-only token, or a job's (that job only)", "",
               "FILE", "TRN_TOKEN_FILE"},
              {"--tls-ca", &a->client.tls_ca_file, "serve-side CA: connect with TLS", "", "PEM"},
              {"--tls-cert", &a->client.tls_cert_file, "client certificate for mTLS (with --tls-key)", "", "PEM"},
              {"--tls-key", &a->client.tls_key_file, "the client certificate's key", "", "PEM"},
              {"--json", &a->json,
               "machine-readable output, with every node and rank (watch: one JSON object per line)"},
              {"--ranks", &a->ranks,
               "status: list every node and rank (a job of more than 64 ranks shows those "
               "needing attention otherwise)"},
              {.name = "--timeout",
               .target = &a->client.rpc_timeout,
               .help = "give up on the coordinator after S seconds",
               .range = Range::kPositive,
               .invalid = kPositive},
              {.name = "--late",
               .target = &a->t.late_s,
               .help = "heartbeat age that makes a member late",
               .value_name = "S",
               .range = Range::kPositive,
               .invalid = kPositive},
              {.name = "--stuck",
               .target = &a->t.stuck_s,
               .help = "heartbeat age that makes a member stuck",
               .value_name = "S",
               .range = Range::kPositive,
               .invalid = kPositive},
              {.name = "--dead",
               .target = &a->t.dead_s,
               .help = "heartbeat age that makes a member dead",
               .value_name = "S",
               .default_text = "the coordinator's heartbeat timeout",
               .range = Range::kPositive,
               .then = [a](auto&, auto&) { a->dead_set = true; },
               .invalid = kPositive},
              {"--no-replay", &a->no_replay, "watch: only new events, not the recent ones the server holds"},
              {.name = "--count", .target = &a->count, .help = "watch: exit after N events", .default_text = "",
               .range = Range::kPositive, .invalid = "expected a positive integer"},
          },
      .style = flags::Style::kColon,
      .positional = flags::Positional::kInterleaved,
      .rest = positional,
      .usage = kUsage,
      .epilogue = kExitCodes,
  };
}

// The command line; std::nullopt after printing --help.
std::optional<Args> parse(int argc, char** argv) {
  Args a;
  a.client.rpc_timeout = std::chrono::seconds(10);
  std::vector<std::string> pos;
  if (!flags::parse(table(&a, &pos), std::vector<std::string>(argv + 1, argv + argc))) return std::nullopt;
  if (pos.empty()) throw usage_error("no command given: use status, watch or checkpoints (see trnctl --help)");
  a.command = pos[0];
  if (a.command != "status" && a.command != "watch" && a.command != "checkpoints")
    throw usage_error("unknown command '{}': use status, watch or checkpoints", a.command);
  if (pos.size() > 2) throw usage_error("{} takes at most one job id", a.command);
  if (pos.size() == 2) a.job = pos[1];
  if (a.command == "checkpoints" && a.job.empty()) throw usage_error("checkpoints needs a job id: trnctl checkpoints JOB");
  const bool from_flag = !a.client.address.empty();
  if (!from_flag) a.client.address = settings::get("TRN_COORDINATOR");
  if (a.client.address.empty())
    throw usage_error("no coordinator: pass --coordinator HOST:PORT or set TRN_COORDINATOR");
  // The address and every TLS file, before anything dials: a port out of range or a bad PEM is
  // one line here, not a retried connection that ends as "unreachable".
  check_client_options(a.client, from_flag ? "--coordinator" : "TRN_COORDINATOR", TlsNames{});
  if (a.client.token.empty() && !settings::get("TRN_TOKEN_FILE").empty())
    a.client.token = read_token_file(settings::get("TRN_TOKEN_FILE"));
  if (!(a.t.late_s <= a.t.stuck_s && (!a.dead_set || a.t.stuck_s <= a.t.dead_s)))
    throw usage_error("thresholds must grow: --late <= --stuck <= --dead");
  return a;
}

// Runs body; a NOT_FOUND answer becomes exit code 4 with its one line.
int with_job_lookup(const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::string m = e.what();
    if (e.kind() == ErrorKind::kUsage && m.find("no job '") != std::string::npos) {
      std::fprintf(stderr, "trnctl: %s\n", m.c_str());
      return kExitNoJob;
    }
    throw;
  }
}

// Up to this many ranks, status lists every node and rank unasked.
constexpr int kSmallJob = 64;
constexpr int kPage = 16384;

// GetStatus of a.job (or every job): the summary, and the ranks from rank_start (max_ranks < 0:
// none).
v1::GetStatusResponse get_status(CoordinatorClient& c, const Args& a, const std::string& job, int rank_start,
                                 int max_ranks, bool checkpoint_shards = false) {
  v1::GetStatusRequest req;
  req.set_job_id(job);
  req.set_checkpoint_shards(checkpoint_shards);
  req.set_rank_start(rank_start);
  req.set_max_ranks(max_ranks);
  req.set_late_ms(static_cast<int64_t>(a.t.late_s * 1000));
  req.set_stuck_ms(static_cast<int64_t>(a.t.stuck_s * 1000));
  if (a.dead_set) req.set_dead_ms(static_cast<int64_t>(a.t.dead_s * 1000));
  v1::GetStatusResponse resp;
  c.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(a.client.rpc_timeout),
                "status");
  return resp;
}

v1::GetStatusResponse get_status(CoordinatorClient& c, const Args& a) {
  return get_status(c, a, a.job, 0, kSmallJob);
}

// Fetches the rest of a job's nodes and ranks, page by page. A node whose ranks span two pages
// comes in both; it is kept once.
void fetch_all_ranks(CoordinatorClient& c, const Args& a, v1::JobStatus* job) {
  int restarts = 0;  // a job changing generations faster than its pages come gets its lists partly
  while (job->next_rank() < job->world_size()) {
    auto page = get_status(c, a, job->job_id(), job->next_rank(), kPage);
    if (page.jobs_size() != 1 || page.jobs(0).next_rank() <= job->next_rank()) break;
    auto* p = page.mutable_jobs(0);
    if (p->generation() != job->generation() || p->world_size() != job->world_size()) {
      if (++restarts > 3) break;
      // The job moved to another generation between pages: start over from its new first page.
      auto first = get_status(c, a, job->job_id(), 0, kPage);
      if (first.jobs_size() != 1) break;
      *job = std::move(*first.mutable_jobs(0));
      continue;
    }
    int last_node = job->nodes_size() ? job->nodes(job->nodes_size() - 1).member().node_rank() : -1;
    for (auto& n : *p->mutable_nodes())
      if (n.member().node_rank() > last_node) *job->add_nodes() = std::move(n);
    for (auto& w : *p->mutable_workers()) *job->add_workers() = std::move(w);
    job->set_next_rank(p->next_rank());
  }
}

int cmd_status(CoordinatorClient& c, Args& a) {
  auto st = get_status(c, a);
  if (!a.dead_set && st.heartbeat_timeout_ms() > 0) a.t.dead_s = st.heartbeat_timeout_ms() / 1000.0;
  if (a.t.stuck_s > a.t.dead_s) a.t.stuck_s = a.t.dead_s;
  if (a.t.late_s > a.t.stuck_s) a.t.late_s = a.t.stuck_s;
  for (auto& j : *st.mutable_jobs()) {
    if (a.ranks || a.json) {
      fetch_all_ranks(c, a, &j);
    } else if (!lists_complete(j)) {
      j.clear_nodes();  // a large job: its summary and the members needing attention
      j.clear_workers();
    }
  }
  std::string out = a.json ? status_json(st, a.t) : status_table(st, a.t);
  std::fwrite(out.data(), 1, out.size(), stdout);
  for (const auto& j : st.jobs())
    if (!job_healthy(j, a.t)) return kExitUnhealthy;
  return 0;
}

int cmd_checkpoints(CoordinatorClient& c, const Args& a) {
  // The table shows each step's first shard; --json lists every shard.
  auto st = get_status(c, a, a.job, 0, -1, a.json);
  const auto& job = st.jobs(0);
  std::string out = a.json ? checkpoints_json(job) + "\n" : checkpoints_table(job);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int cmd_watch(CoordinatorClient& c, const Args& a) {
  if (!a.job.empty()) get_status(c, a);  // NOT_FOUND early, with exit code 4
  long seen = 0;
  bool replay = !a.no_replay;
  auto& impl = c.impl();
  for (;;) {
    grpc::ClientContext ctx;
    if (!impl.options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + impl.options.token);
    v1::WatchEventsRequest req;
    req.set_job_id(a.job);
    req.set_replay(replay);
    auto reader = impl.stub()->WatchEvents(&ctx, req);
    v1::Event ev;
    while (reader->Read(&ev)) {
      std::string line = a.json ? event_json(ev) : event_line(ev);
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fflush(stdout);
      if (a.count > 0 && ++seen >= a.count) {
        ctx.TryCancel();
        reader->Finish();
        return 0;
      }
    }
    grpc::Status s = reader->Finish();
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) throw to_error(s, "watch", impl.options.address);
    // The coordinator went away: wait for it to come back (bounded by --timeout) and go on.
    replay = false;
    v1::GetStatusRequest sreq;
    sreq.set_job_id(a.job);  // what the watch's token may read (a job's token: its job only)
    sreq.set_max_ranks(-1);
    v1::GetStatusResponse sresp;
    impl.call(&v1::Coordinator::Stub::GetStatus, sreq, &sresp, Deadline::after(impl.options.rpc_timeout),
              "watch (reconnecting)");
  }
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  return run_main("trnctl", [&] {
    std::optional<Args> parsed = parse(argc, argv);
    if (!parsed) return 0;
    Args& a = *parsed;
    CoordinatorClient client(a.client);
    return with_job_lookup([&] {
      if (a.command == "status") return cmd_status(client, a);
      if (a.command == "checkpoints") return cmd_checkpoints(client, a);
      return cmd_watch(client, a);
    });
  });
}
