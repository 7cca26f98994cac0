// trnctl: what a trn job is doing, from its coordinator.
//
// Exit codes (for scripts): 0 ok (status: every job shown is healthy, completed, or stopped by
// its user: a stop is intended, not a fault), 1 coordinator unreachable or another failure, 2
// usage error, 3 a job shown is unhealthy (a member late, stuck, dead or unknown, or the job
// forming or failed), 4 no such job.
#include <signal.h>

#include <cstdio>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/main.h"
#include "collectives/core/settings.h"
#include "launcher/client/coordinator_client.h"
#include "launcher/client/rpc.h"
#include "launcher/client/status_report.h"

using namespace trn;
using namespace trn::control;

namespace {

const char* kUsage =
    "usage: trnctl [options] status [JOB]        jobs, members, health, progress, restarts\n"
    "       trnctl [options] watch [JOB]         live events (joins, failures, generations,\n"
    "                                            checkpoint commits) until interrupted\n"
    "       trnctl [options] checkpoints JOB     committed checkpoints of a job\n"
    "\n"
    "options:\n"
    "  --coordinator HOST:PORT   coordinator address (default: TRN_COORDINATOR)\n"
    "  --token-file FILE         bearer token (default: TRN_TOKEN_FILE)\n"
    "  --tls-ca PEM              serve-side CA: connect with TLS\n"
    "  --tls-cert PEM --tls-key PEM  client certificate for mTLS\n"
    "  --json                    machine-readable output (watch: one JSON object per line)\n"
    "  --timeout S               give up on the coordinator after S seconds (default 10)\n"
    "  --late S --stuck S --dead S  heartbeat ages that make a member late, stuck, dead\n"
    "                            (defaults 3, 10, and the coordinator's heartbeat timeout)\n"
    "  --no-replay               watch: only new events, not the recent ones the server holds\n"
    "  --count N                 watch: exit after N events\n"
    "\n"
    "exit codes: 0 ok (healthy, completed or stopped), 1 coordinator unreachable or failed, 2 usage,\n"
    "            3 job unhealthy (or forming, or failed), 4 no such job\n";

constexpr int kExitUnhealthy = 3;
constexpr int kExitNoJob = 4;

double parse_positive(const std::string& v, const std::string& flag) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !(x > 0)) throw usage_error("{} {}: expected a positive number", flag, v);
  return x;
}

struct Args {
  ClientOptions client;
  std::string command, job;
  bool json = false, replay = true;
  long count = -1;
  HealthThresholds t;
  bool dead_set = false;
};

Args parse(int argc, char** argv) {
  Args a;
  a.client.rpc_timeout = std::chrono::seconds(10);
  std::vector<std::string> pos;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error("{} needs a value (see trnctl --help)", f);
      return argv[++i];
    };
    if (f == "-h" || f == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (f == "--coordinator") a.client.address = value();
    else if (f == "--token-file") a.client.token = read_token_file(value());
    else if (f == "--tls-ca") a.client.tls_ca_file = value();
    else if (f == "--tls-cert") a.client.tls_cert_file = value();
    else if (f == "--tls-key") a.client.tls_key_file = value();
    else if (f == "--json") a.json = true;
    else if (f == "--no-replay") a.replay = false;
    else if (f == "--timeout")
      a.client.rpc_timeout = std::chrono::duration_cast<Duration>(
          std::chrono::duration<double>(parse_positive(value(), f)));
    else if (f == "--late") a.t.late_s = parse_positive(value(), f);
    else if (f == "--stuck") a.t.stuck_s = parse_positive(value(), f);
    else if (f == "--dead") a.t.dead_s = parse_positive(value(), f), a.dead_set = true;
    else if (f == "--count") a.count = static_cast<long>(parse_positive(value(), f));
    else if (!f.empty() && f[0] == '-') throw usage_error("unknown option '{}' (see trnctl --help)", f);
    else pos.push_back(f);
  }
  if (pos.empty()) throw usage_error("no command given: use status, watch or checkpoints (see trnctl --help)");
  a.command = pos[0];
  if (a.command != "status" && a.command != "watch" && a.command != "checkpoints")
    throw usage_error("unknown command '{}': use status, watch or checkpoints", a.command);
  if (pos.size() > 2) throw usage_error("{} takes at most one job id", a.command);
  if (pos.size() == 2) a.job = pos[1];
  if (a.command == "checkpoints" && a.job.empty()) throw usage_error("checkpoints needs a job id: trnctl checkpoints JOB");
  if (a.client.address.empty()) a.client.address = settings::get("TRN_COORDINATOR");
  if (a.client.address.empty())
    throw usage_error("no coordinator: pass --coordinator HOST:PORT or set TRN_COORDINATOR");
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

v1::GetStatusResponse get_status(CoordinatorClient& c, const Args& a) {
  v1::GetStatusRequest req;
  req.set_job_id(a.job);
  v1::GetStatusResponse resp;
  c.impl().call(&v1::Coordinator::Stub::GetStatus, req, &resp, Deadline::after(a.client.rpc_timeout),
                "status");
  return resp;
}

int cmd_status(CoordinatorClient& c, Args& a) {
  auto st = get_status(c, a);
  if (!a.dead_set && st.heartbeat_timeout_ms() > 0) a.t.dead_s = st.heartbeat_timeout_ms() / 1000.0;
  if (a.t.stuck_s > a.t.dead_s) a.t.stuck_s = a.t.dead_s;
  if (a.t.late_s > a.t.stuck_s) a.t.late_s = a.t.stuck_s;
  std::string out = a.json ? status_json(st, a.t) : status_table(st, a.t);
  std::fwrite(out.data(), 1, out.size(), stdout);
  for (const auto& j : st.jobs())
    if (!job_healthy(j, a.t)) return kExitUnhealthy;
  return 0;
}

int cmd_checkpoints(CoordinatorClient& c, const Args& a) {
  auto st = get_status(c, a);
  const auto& job = st.jobs(0);
  std::string out = a.json ? checkpoints_json(job) + "\n" : checkpoints_table(job);
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

int cmd_watch(CoordinatorClient& c, const Args& a) {
  if (!a.job.empty()) get_status(c, a);  // NOT_FOUND early, with exit code 4
  long seen = 0;
  bool replay = a.replay;
  auto& impl = c.impl();
  for (;;) {
    grpc::ClientContext ctx;
    if (!impl.options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + impl.options.token);
    v1::WatchEventsRequest req;
    req.set_job_id(a.job);
    req.set_replay(replay);
    auto reader = impl.stub->WatchEvents(&ctx, req);
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
    v1::GetStatusResponse sresp;
    impl.call(&v1::Coordinator::Stub::GetStatus, sreq, &sresp, Deadline::after(impl.options.rpc_timeout),
              "watch (reconnecting)");
  }
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  return run_main("trnctl", [&] {
    Args a = parse(argc, argv);
    CoordinatorClient client(a.client);
    return with_job_lookup([&] {
      if (a.command == "status") return cmd_status(client, a);
      if (a.command == "checkpoints") return cmd_checkpoints(client, a);
      return cmd_watch(client, a);
    });
  });
}
