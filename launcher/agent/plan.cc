#include "launcher/agent/plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>

#include "launcher/agent/worker_env.h"
#include "launcher/client/agent_channel.h"

namespace trn::launch {
namespace {

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                        "-_./=:,+@%") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

template <typename... Args>
void add_line(std::string& out, fmt::format_string<Args...> f, Args&&... args) {
  out += fmt::format(f, std::forward<Args>(args)...);
  out += '\n';
}

}  // namespace

std::string log_path(const std::string& log_dir, int rank, int64_t generation) {
  return fmt::format("{}/rank{}.gen{}.log", log_dir, rank, generation);
}

std::vector<WorkerSpec> plan_workers(const LaunchOptions& options, const control::JoinResult& joined,
                                     const std::string& coordinator, const std::string& agent_socket,
                                     const std::string& token_file) {
  std::vector<WorkerSpec> specs;
  const std::vector<std::vector<int>> cpus = plan_binding(options.bind, options.nproc_per_node);
  for (int local = 0; local < options.nproc_per_node; ++local) {
    WorkerIdentity id;
    id.rank = joined.rank_offset + local;
    id.local_rank = local;
    id.world_size = joined.world_size;
    id.local_world_size = options.nproc_per_node;
    id.node_rank = joined.node_rank;
    id.generation = joined.generation;
    id.job_id = options.job_id;
    id.coordinator = coordinator;
    id.token_file = token_file.empty() ? options.token_file : token_file;
    id.tls_ca = options.tls_ca;
    id.tls_cert = options.tls_cert;
    id.tls_key = options.tls_key;
    WorkerSpec spec;
    spec.rank = id.rank;
    spec.local_rank = local;
    spec.argv = options.command;
    spec.env = worker_env_vars(id);
    if (!cpus.empty()) spec.cpus = cpus[local];
    // Set empty rather than left out when this trnrun has no socket of its own but inherited
    // one (trnrun started by a worker of another trnrun): the outer agent would drop these ranks.
    if (!agent_socket.empty() || std::getenv(control::kAgentSocketEnv))
      spec.env[control::kAgentSocketEnv] = agent_socket;
    // In place, a worker keeps running through another's failure and waits for the agent's
    // resume (heartbeat_relay.h). Set explicitly to restart only to override one inherited from
    // an outer trnrun (a trnrun started by a worker of another).
    if (options.recovery == Recovery::kInPlace) spec.env["TRN_RECOVERY"] = "in-place";
    else if (std::getenv("TRN_RECOVERY")) spec.env["TRN_RECOVERY"] = "restart";
    // The run's identity; one the user (or a scheduler's requeue) set for trnrun is inherited
    // unchanged, so that it stays one run across invocations.
    const char* user_run_id = std::getenv("TRN_RUN_ID");
    if ((!user_run_id || !*user_run_id) && !joined.run_id.empty()) spec.env["TRN_RUN_ID"] = joined.run_id;
    spec.sink.prefix = fmt::format("[rank {}] ", id.rank);
    spec.sink.console = options.log_dir.empty() || options.tee;
    if (!options.log_dir.empty()) spec.sink.log_path = log_path(options.log_dir, id.rank, id.generation);
    specs.push_back(std::move(spec));
  }
  return specs;
}

std::string format_dry_run(const LaunchOptions& o) {
  control::JoinResult assumed;
  assumed.node_rank = o.node_rank_hint >= 0 ? o.node_rank_hint : 0;
  assumed.nnodes = o.max_nodes;
  assumed.world_size = o.max_nodes * o.nproc_per_node;
  assumed.rank_offset = assumed.node_rank * o.nproc_per_node;
  std::string coordinator = o.coordinator.empty() ? "127.0.0.1:PORT" : o.coordinator;
  std::string out;
  add_line(out, "trnrun plan (dry run: nothing started)");
  add_line(out, "  job id:        {}", o.job_id);
  if (o.min_nodes == o.max_nodes) add_line(out, "  nodes:         {}", o.max_nodes);
  else add_line(out, "  nodes:         {} to {} (elastic; the plan assumes {})", o.min_nodes, o.max_nodes, o.max_nodes);
  add_line(out, "  this node:     rank {}{}", assumed.node_rank,
       o.node_rank_hint >= 0 ? "" : " (assumed; the coordinator assigns it)");
  if (!o.scheduler.empty()) add_line(out, "  scheduler:     {} (node count and rank from its environment)", o.scheduler);
  add_line(out, "  workers:       {} on this node, ranks {}..{} of world size {}", o.nproc_per_node,
       assumed.rank_offset, assumed.rank_offset + o.nproc_per_node - 1, assumed.world_size);
  add_line(out, "  coordinator:   {}", o.coordinator.empty()
                                  ? "embedded: trn-coordinator on a free loopback port, stopped at the end"
                                  : o.coordinator);
  if (!o.token_file.empty())
    add_line(out,
             "  token:         {} for trnrun; its workers get their job's own token (TRN_TOKEN_FILE in "
             "trnrun's private folder)",
             o.token_file);
  if (!o.tls_ca.empty() || !o.tls_cert.empty())
    add_line(out, "  TLS:           {}{}", o.tls_ca.empty() ? "the system's CAs" : "CA " + o.tls_ca,
             o.tls_cert.empty() ? "" : ", client certificate " + o.tls_cert);
  add_line(out, "  max restarts:  {}", o.max_restarts);
  add_line(out, "  recovery:      {}", o.recovery == Recovery::kInPlace
                                      ? "in-place (survivors keep running; only failed workers start anew)"
                                      : "restart (every worker starts anew in the new generation)");
  add_line(out, "  grace period:  {:.3g} s", std::chrono::duration<double>(o.grace_period).count());
  add_line(out, "  output:        {}", o.log_dir.empty() ? std::string("console, prefixed with the rank")
                                                : fmt::format("{}/rank<R>.gen<G>.log{}", o.log_dir,
                                                              o.tee ? " and console" : ""));
  std::vector<std::string> quoted;
  for (const auto& a : o.command) quoted.push_back(shell_quote(a));
  add_line(out, "  command:       {}", fmt::join(quoted, " "));
  const std::string token_file = o.token_file.empty() ? "" : std::string("TRNRUN_DIR/") + kJobTokenFile;
  const std::vector<WorkerSpec> specs = plan_workers(o, assumed, coordinator, "", token_file);
  const bool bound = !specs.empty() && !specs[0].cpus.empty();
  add_line(out, "  binding:       {}", bound ? "core (each rank on the cpus below)"
                                          : o.bind == Bind::kNone ? "none (workers run on trnrun's cpus)"
                                                                  : "none (fewer cpus than workers)");
  for (const auto& spec : specs) {
    std::vector<std::string> env;
    for (const auto& [k, v] : spec.env) env.push_back(k + "=" + shell_quote(v));
    add_line(out, "  rank {}: {}{}", spec.rank, fmt::join(env, " "),
             spec.cpus.empty() ? "" : " (cpus " + format_cpu_list(spec.cpus) + ")");
  }
  return out;
}

}  // namespace trn::launch
