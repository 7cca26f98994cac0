#include "launcher/agent/options.h"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <random>

#include "collectives/core/error.h"

namespace trn::launch {
namespace {

namespace fs = std::filesystem;

bool parse_int(const std::string& s, int* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

int int_option(const std::string& name, const std::string& value, int min_value) {
  int v = 0;
  if (!parse_int(value, &v)) throw usage_error("{} {}: expected an integer", name, value);
  if (v < min_value) throw usage_error("{} {}: must be at least {}", name, value, min_value);
  return v;
}

Duration seconds_option(const std::string& name, const std::string& value, bool allow_zero) {
  char* end = nullptr;
  double s = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || !std::isfinite(s) || s < 0 || (!allow_zero && s == 0))
    throw usage_error("{} {}: expected a {} number of seconds", name, value,
                      allow_zero ? "non-negative" : "positive");
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

void parse_nnodes(const std::string& value, LaunchOptions& o) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    o.min_nodes = o.max_nodes = int_option("--nnodes", value, 1);
    return;
  }
  o.min_nodes = int_option("--nnodes", value.substr(0, colon), 1);
  o.max_nodes = int_option("--nnodes", value.substr(colon + 1), 1);
  if (o.max_nodes < o.min_nodes)
    throw usage_error("--nnodes {}: MIN:MAX needs MIN <= MAX", value);
}

std::optional<int> env_int(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  int x = 0;
  if (!parse_int(*v, &x) || x < 0)
    throw usage_error("{}={} is not a non-negative integer (set by the scheduler?)", name, *v);
  return x;
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

std::string normalize_flag(std::string flag) {
  for (auto& c : flag)
    if (c == '_') c = '-';
  return flag;
}

}  // namespace

std::string generate_job_id() {
  std::random_device rd;
  std::mt19937_64 gen((uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid()));
  return fmt::format("trn-{:012x}", gen() & 0xffffffffffffULL);
}

void check_host_port(const std::string& value, const std::string& what) {
  auto colon = value.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 || !parse_int(value.substr(colon + 1), &port) ||
      port < 1 || port > 65535)
    throw usage_error("{} {}: expected HOST:PORT with a port in 1..65535", what, value);
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

LaunchOptions parse_launch_options(const std::vector<std::string>& args, const EnvLookup& env) {
  LaunchOptions o;
  o.join_timeout = default_timeout();
  apply_scheduler_defaults(env, o);
  bool explicit_nnodes = false;
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program
    std::string flag = arg, value;
    bool has_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos && arg.rfind("--", 0) == 0) {
      flag = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    flag = normalize_flag(flag);
    auto take = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= args.size()) throw usage_error("{} needs a value (see trnrun --help)", flag);
      return args[++i];
    };
    auto no_value = [&]() {
      if (has_value) throw usage_error("{} takes no value", flag);
    };
    if (flag == "--help" || flag == "-h") {
      o.help = true;
      return o;
    } else if (flag == "--nnodes") {
      parse_nnodes(take(), o);
      explicit_nnodes = true;
    } else if (flag == "--nproc-per-node") {
      o.nproc_per_node = int_option(flag, take(), 1);
    } else if (flag == "--node-rank") {
      o.node_rank_hint = int_option(flag, take(), 0);
    } else if (flag == "--coordinator") {
      o.coordinator = take();
      check_host_port(o.coordinator, flag);
    } else if (flag == "--job-id") {
      o.job_id = take();
      if (o.job_id.empty()) throw usage_error("--job-id must not be empty");
    } else if (flag == "--token-file") {
      std::string f = take();
      std::error_code ec;
      if (!fs::is_regular_file(f, ec) || access(f.c_str(), R_OK) != 0)
        throw usage_error("--token-file {}: not a readable file", f);
      o.token_file = fs::absolute(f).lexically_normal().string();
    } else if (flag == "--max-restarts") {
      o.max_restarts = int_option(flag, take(), 0);
    } else if (flag == "--log-dir") {
      o.log_dir = take();
      if (o.log_dir.empty()) throw usage_error("--log-dir must not be empty");
    } else if (flag == "--tee") {
      no_value();
      o.tee = true;
    } else if (flag == "--dry-run") {
      no_value();
      o.dry_run = true;
    } else if (flag == "--monitor-interval") {
      o.monitor_interval = seconds_option(flag, take(), false);
    } else if (flag == "--grace-period") {
      o.grace_period = seconds_option(flag, take(), true);
    } else if (flag == "--join-timeout") {
      o.join_timeout = seconds_option(flag, take(), false);
    } else {
      throw usage_error("unknown option {} (see trnrun --help)", flag);
    }
  }
  if (i >= args.size()) throw usage_error("no program to run; usage: trnrun [options] -- PROGRAM [ARGS]");
  o.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  o.command[0] = resolve_program(o.command[0], env("PATH").value_or("/usr/bin:/bin"));

  if (o.node_rank_hint >= o.max_nodes)
    throw usage_error("--node-rank {} is out of range for --nnodes {} (ranks 0..{})", o.node_rank_hint,
                      o.max_nodes, o.max_nodes - 1);
  if (o.max_nodes > 1 && o.coordinator.empty())
    throw usage_error("{} nodes need --coordinator HOST:PORT (the embedded coordinator serves one node){}",
                      o.max_nodes,
                      explicit_nnodes || o.scheduler.empty() ? "" : fmt::format("; node count from {}", o.scheduler));
  if (o.tee && o.log_dir.empty()) throw usage_error("--tee needs --log-dir DIR");
  if (o.job_id.empty()) o.job_id = generate_job_id();
  return o;
}

std::string usage() {
  return R"(usage: trnrun [options] [--] PROGRAM [ARGS...]

Starts --nproc-per-node workers of PROGRAM on this node, rendezvous with the other nodes through
the coordinator, and supervises them: output prefixed with the rank, signals forwarded, failed
groups restarted in a new generation while --max-restarts allow.

  --nnodes N|MIN:MAX       nodes in the job (default 1, or from Slurm / Open MPI)
  --nproc-per-node K       workers on this node (default 1, or SLURM_NTASKS_PER_NODE)
  --node-rank R            preferred rank of this node (the coordinator has the last word)
  --coordinator HOST:PORT  trn-coordinator to use; without it (one node only) trnrun starts one
                           on a free loopback port and stops it at the end
  --job-id ID              job id at the coordinator (default: generated, or from the scheduler)
  --token-file FILE        bearer token for the coordinator (also given to workers)
  --max-restarts N         restarts of the worker group after failures (default 0)
  --log-dir DIR            write each rank's output to DIR/rank<R>.gen<G>.log instead of the console
  --tee                    with --log-dir: print to the console as well
  --dry-run                print the plan (nodes, ranks, environment, command), start nothing
  --monitor-interval S     seconds between checks of the workers (default 0.1)
  --grace-period S         seconds workers get to stop after a signal before SIGKILL (default 10)
  --join-timeout S         seconds to wait for the other nodes to join (default TRN_TIMEOUT)

Workers get TRN_RANK, TRN_LOCAL_RANK, TRN_WORLD_SIZE, TRN_LOCAL_WORLD_SIZE, TRN_NODE_RANK,
TRN_COORDINATOR, TRN_JOB_ID, TRN_GENERATION, TRN_RUN_ID (the run's id, kept by restarts; one set
for trnrun is passed on unchanged) (and TRN_TOKEN_FILE).
)";
}

}  // namespace trn::launch
