#include "launcher/agent/options.h"

#include <unistd.h>

#include <filesystem>
#include <limits>
#include <random>
#include <set>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "launcher/client/address.h"
#include "launcher/client/tls_files.h"

namespace trn::launch {
namespace {

namespace fs = std::filesystem;

// "--nnodes N" or "--nnodes MIN:MAX", each a node count of at least 1.
void parse_nnodes(const std::string& flag, const std::string& value, LaunchOptions& o) {
  auto count = [&](const std::string& part) {
    const auto n = flags::to_number<int>(part);
    // Digits that an int cannot hold are a count out of range, not "no integer".
    const bool digits = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    if (!n && digits)
      throw usage_error("{} {}: must be at most {}", flag, part, std::numeric_limits<int>::max());
    if (!n) throw usage_error("{} {}: expected an integer", flag, part);
    if (*n < 1) throw usage_error("{} {}: must be at least 1", flag, part);
    return *n;
  };
  const auto colon = value.find(':');
  if (colon == std::string::npos) {
    o.min_nodes = o.max_nodes = count(value);
    return;
  }
  o.min_nodes = count(value.substr(0, colon));
  o.max_nodes = count(value.substr(colon + 1));
  if (o.max_nodes < o.min_nodes) throw usage_error("{} {}: MIN:MAX needs MIN <= MAX", flag, value);
}

std::optional<int> env_int(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  const auto x = flags::to_number<int>(*v);
  if (!x || *x < 0) throw usage_error("{}={} is not a non-negative integer (set by the scheduler?)", name, *v);
  return *x;
}

// Scheduler defaults, applied before explicit options overwrite them.
void apply_scheduler_defaults(const EnvLookup& env, LaunchOptions& o) {
  if (auto size = env_int(env, "OMPI_COMM_WORLD_SIZE")) {
    o.scheduler = "openmpi";
    o.min_nodes = o.max_nodes = *size;
    o.node_rank_hint = env_int(env, "OMPI_COMM_WORLD_RANK").value_or(0);
    if (auto id = env("OMPI_MCA_ess_base_jobid")) o.job_id = "ompi-" + *id;
    return;
  }
  auto nnodes = env_int(env, "SLURM_NNODES");
  auto slurm_job = env("SLURM_JOB_ID");
  if (nnodes && slurm_job) {
    o.scheduler = "slurm";
    auto ntasks = env_int(env, "SLURM_NTASKS");
    if (ntasks && *ntasks > *nnodes) {
      o.min_nodes = o.max_nodes = *ntasks;
      o.node_rank_hint = env_int(env, "SLURM_PROCID").value_or(0);
    } else {
      o.min_nodes = o.max_nodes = *nnodes;
      o.node_rank_hint = env_int(env, "SLURM_NODEID").value_or(0);
      // One trnrun per node of an allocation made with --ntasks-per-node=K: K workers each.
      if (auto per_node = env_int(env, "SLURM_NTASKS_PER_NODE"); per_node && *per_node > 0)
        o.nproc_per_node = *per_node;
    }
    o.job_id = "slurm-" + *slurm_job;
    if (auto step = env("SLURM_STEP_ID")) o.job_id += "." + *step;
  }
}

}  // namespace

std::string generate_job_id() {
  std::random_device rd;
  std::mt19937_64 gen((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid()));
  return fmt::format("trn-{:012x}", gen() & 0xffffffffffffULL);
}

std::string resolve_program(const std::string& program, const std::string& path_var) {
  auto executable = [](const fs::path& p) {
    std::error_code ec;
    return fs::is_regular_file(p, ec) && access(p.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    std::error_code ec;
    if (fs::is_regular_file(program, ec) && !executable(program))
      throw usage_error("program {} is not executable; chmod +x it or run it through its interpreter "
                        "(trnrun -- python3 {})", program, program);
    if (!executable(program)) throw usage_error("program {} is not an executable file; check the path", program);
    return fs::absolute(program).lexically_normal().string();
  }
  size_t start = 0;
  while (start <= path_var.size()) {
    size_t end = path_var.find(':', start);
    if (end == std::string::npos) end = path_var.size();
    std::string dir = path_var.substr(start, end - start);
    fs::path candidate = fs::path(dir.empty() ? "." : dir) / program;
    if (executable(candidate)) return fs::absolute(candidate).lexically_normal().string();
    start = end + 1;
  }
  throw usage_error("program {} not found on PATH; give its path or fix PATH", program);
}

namespace {

constexpr const char* kSummary =
    "\nStarts --nproc-per-node workers of PROGRAM on this node, rendezvous with the other nodes through\n"
    "the coordinator, and supervises them: output prefixed with the rank, signals forwarded, failed\n"
    "groups restarted in a new generation while --max-restarts allow (or, with --recovery in-place, only\n"
    "the failed workers, the others rebuilding in place).\n";

constexpr const char* kEpilogue =
    "Workers get TRN_RANK, TRN_LOCAL_RANK, TRN_WORLD_SIZE, TRN_LOCAL_WORLD_SIZE, TRN_NODE_RANK,\n"
    "TRN_COORDINATOR, TRN_JOB_ID, TRN_GENERATION, TRN_RUN_ID (the run's id, kept by restarts; one set\n"
    "for trnrun is passed on unchanged) (and TRN_TOKEN_FILE: their job's token; TRN_TLS_CA,\n"
    "TRN_TLS_CERT, TRN_TLS_KEY with --tls-*), and TRN_RECOVERY=in-place with --recovery in-place.\n";

void not_empty(const std::string& flag, const std::string& value) {
  if (value.empty()) throw usage_error("{} must not be empty", flag);
}

// A flag naming a file trnrun and its workers read: readable now, kept as an absolute path (the
// workers run in other folders).
flags::Parser readable_file(std::string* target) {
  return [target](const std::string& flag, const std::string& value) {
    std::error_code ec;
    if (!fs::is_regular_file(value, ec) || access(value.c_str(), R_OK) != 0)
      throw usage_error("{} {}: not a readable file", flag, value);
    *target = fs::absolute(value).lexically_normal().string();
  };
}

// trnrun's flags, setting the members of *o; the worker command goes to *command. --help renders
// the defaults from *o, so build it on a default LaunchOptions for help.
flags::Table table(LaunchOptions* o, std::vector<std::string>* command) {
  using flags::Range;
  return {
      .program = "trnrun",
      .summary = kSummary,
      .flags =
          {
              {"--nnodes", [o](auto& f, auto& v) { parse_nnodes(f, v, *o); }, "nodes in the job", "", "N|MIN:MAX",
               "1, or from Slurm / Open MPI"},
              {.name = "--nproc-per-node", .target = &o->nproc_per_node, .help = "workers on this node",
               .value_name = "K", .default_text = "1, or SLURM_NTASKS_PER_NODE", .range = Range::kAtLeast, .min = 1},
              {.name = "--node-rank", .target = &o->node_rank_hint,
               .help = "preferred rank of this node (the coordinator has the last word)", .value_name = "R",
               .default_text = "", .range = Range::kAtLeast, .min = 0},
              {.name = "--coordinator", .target = &o->coordinator,
               .help = "trn-coordinator to use (several: the replicas of one with --store etcd://..., tried in "
                       "turn); without it (one node only) trnrun starts one on a free loopback port and stops it "
                       "at the end",
               .value_name = "HOST:PORT[,HOST:PORT...]",
               .then = [](auto& f, auto& v) { control::parse_address_list(v, f); }},
              {.name = "--job-id", .target = &o->job_id, .help = "job id at the coordinator", .value_name = "ID",
               .default_text = "generated, or from the scheduler", .then = not_empty},
              {"--token-file", readable_file(&o->token_file),
               "the coordinator's bearer token; workers get their job's own token from the coordinator "
               "(or this one, from a coordinator without job tokens)",
               "", "FILE"},
              {"--tls-ca", readable_file(&o->tls_ca),
               "connect to --coordinator with TLS, verifying its certificate against this CA (workers "
               "too)",
               "", "PEM"},
              {"--tls-cert", readable_file(&o->tls_cert),
               "client certificate for a coordinator that requires one (mTLS; with --tls-key; workers "
               "too)",
               "", "PEM"},
              {"--tls-key", readable_file(&o->tls_key), "the key of --tls-cert", "", "PEM"},
              {.name = "--max-restarts", .target = &o->max_restarts,
               .help = "restarts of the worker group after failures", .range = Range::kAtLeast, .min = 0},
              {.name = "--recovery",
               .target = [o](auto&, auto& v) { o->recovery = v == "in-place" ? Recovery::kInPlace : Recovery::kRestart; },
               .help = "after a failure, restart: stop every worker and start the group anew; in-place: survivors "
                       "keep running and rebuild in the new generation, only dead workers start anew (each uses a "
                       "restart either way)",
               .value_name = "restart|in-place", .default_text = "restart", .choices = "restart|in-place"},
              {.name = "--bind",
               .target = [o](auto&, auto& v) { o->bind = v == "none" ? Bind::kNone : Bind::kCore; },
               .help = "core: each worker runs on its own share of the CPUs trnrun may run on (disjoint, whole "
                       "cores where there are enough), as mpirun --bind-to core; none: workers inherit trnrun's "
                       "CPUs and the OS places them",
               .value_name = "core|none", .default_text = "core, or none when trnrun may run on fewer CPUs than "
                                                          "--nproc-per-node",
               .choices = "core|none"},
              {.name = "--log-dir", .target = &o->log_dir,
               .help = "write each rank's output to DIR/rank<R>.gen<G>.log instead of the console",
               .value_name = "DIR", .then = not_empty},
              {"--tee", &o->tee, "with --log-dir: print to the console as well"},
              {"--dry-run", &o->dry_run, "print the plan (nodes, ranks, environment, command), start nothing"},
              {.name = "--monitor-interval", .target = &o->monitor_interval,
               .help = "seconds between checks of the workers", .range = Range::kPositive,
               .invalid = "expected a positive number of seconds"},
              {.name = "--grace-period", .target = &o->grace_period,
               .help = "seconds workers get to stop after a signal before SIGKILL", .range = Range::kNonNegative,
               .invalid = "expected a non-negative number of seconds"},
              {.name = "--join-timeout", .target = &o->join_timeout,
               .help = "seconds to wait for the other nodes to join", .default_text = "TRN_TIMEOUT",
               .range = Range::kPositive, .invalid = "expected a positive number of seconds"},
          },
      .style = flags::Style::kColon,
      .positional = flags::Positional::kRest,
      .rest = command,
      .usage = "[options] [--] PROGRAM [ARGS...]",
      .epilogue = kEpilogue,
      .underscores = true,
  };
}

}  // namespace

LaunchOptions parse_launch_options(const std::vector<std::string>& args, const EnvLookup& env) {
  LaunchOptions o;
  o.join_timeout = default_timeout();
  apply_scheduler_defaults(env, o);
  std::set<std::string> given;
  if (!flags::parse(table(&o, &o.command), args, &given)) {
    o.help = true;
    return o;
  }
  const bool explicit_nnodes = given.count("--nnodes") > 0;
  if (o.command.empty()) throw usage_error("no program to run; usage: trnrun [options] -- PROGRAM [ARGS]");
  o.command[0] = resolve_program(o.command[0], env("PATH").value_or("/usr/bin:/bin"));

  if (o.node_rank_hint >= o.max_nodes)
    throw usage_error("--node-rank {} is out of range for --nnodes {} (ranks 0..{})", o.node_rank_hint,
                      o.max_nodes, o.max_nodes - 1);
  if (o.max_nodes > 1 && o.coordinator.empty())
    throw usage_error("{} nodes need --coordinator HOST:PORT (the embedded coordinator serves one node){}",
                      o.max_nodes,
                      explicit_nnodes || o.scheduler.empty() ? "" : fmt::format("; node count from {}", o.scheduler));
  // Checked now, on trnrun's own CPUs, rather than when the workers start.
  if (o.bind == Bind::kCore) plan_binding(o.bind, o.nproc_per_node);
  if (o.tee && o.log_dir.empty()) throw usage_error("--tee needs --log-dir DIR");
  if (o.tls_cert.empty() != o.tls_key.empty())
    throw usage_error("--tls-cert and --tls-key go together; give both");
  // The embedded coordinator listens on loopback only, where TLS protects nothing a local root
  // could not read anyway; it has no server certificate to serve it with.
  if (o.coordinator.empty() && (!o.tls_ca.empty() || !o.tls_cert.empty()))
    throw usage_error(
        "{} needs --coordinator HOST:PORT: the embedded coordinator serves plaintext on loopback only",
        o.tls_ca.empty() ? "--tls-cert" : "--tls-ca");
  // Loaded and checked now (PEM, a certificate in it, the key matching it), before anything dials:
  // gRPC would take a bad file and retry the join until TRN_TIMEOUT without saying why.
  control::load_tls_files({o.tls_ca, o.tls_cert, o.tls_key});
  if (o.job_id.empty()) o.job_id = generate_job_id();
  return o;
}

std::string usage() {
  LaunchOptions defaults;
  return flags::help(table(&defaults, &defaults.command));
}

}  // namespace trn::launch
