#include "launcher/agent/worker_env.h"

#include <charconv>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

namespace trn::launch {
namespace {

template <typename T>
std::optional<T> read_int(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  T x{};
  auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
  if (v->empty() || ec != std::errc() || p != v->data() + v->size() || x < 0)
    throw usage_error("{}={} is not a non-negative integer", name, *v);
  return x;
}

template <typename T>
T required_int(const EnvLookup& env, const std::string& name, const std::string& because) {
  auto v = read_int<T>(env, name);
  if (!v) throw usage_error("{} is not set but {} is; set both (or neither)", name, because);
  return *v;
}

// SLURM_TASKS_PER_NODE looks like "2(x3),1": tasks on each node, with repeat counts.
std::optional<int> slurm_tasks_on_node(const std::string& spec, int node) {
  int index = 0;
  size_t pos = 0;
  while (pos < spec.size()) {
    size_t end = spec.find(',', pos);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(pos, end - pos);
    int tasks = 0, repeat = 1;
    if (std::sscanf(item.c_str(), "%d(x%d)", &tasks, &repeat) < 1) return std::nullopt;
    if (node < index + repeat) return tasks;
    index += repeat;
    pos = end + 1;
  }
  return std::nullopt;
}

void check(const WorkerIdentity& id, const char* what) {
  if (id.world_size < 1) throw usage_error("{}: world size must be at least 1", what);
  if (id.rank >= id.world_size)
    throw usage_error("{}: rank {} is out of range for world size {}", what, id.rank, id.world_size);
  if (id.local_world_size < 1 || id.local_rank >= id.local_world_size)
    throw usage_error("{}: local rank {} is out of range for local world size {}", what, id.local_rank,
                      id.local_world_size);
}

}  // namespace

const char* to_string(IdentitySource source) {
  switch (source) {
    case IdentitySource::kTrnrun: return "trnrun";
    case IdentitySource::kOpenMpi: return "openmpi";
    case IdentitySource::kSlurm: return "slurm";
    case IdentitySource::kSingle: return "single";
  }
  return "?";
}

WorkerIdentity identity_from(const EnvLookup& env) {
  WorkerIdentity id;
  if (auto rank = read_int<int>(env, "TRN_RANK")) {
    id.source = IdentitySource::kTrnrun;
    id.rank = *rank;
    id.world_size = required_int<int>(env, "TRN_WORLD_SIZE", "TRN_RANK");
    id.local_rank = read_int<int>(env, "TRN_LOCAL_RANK").value_or(id.rank);
    id.local_world_size = read_int<int>(env, "TRN_LOCAL_WORLD_SIZE").value_or(id.world_size);
    id.node_rank = read_int<int>(env, "TRN_NODE_RANK").value_or(0);
    check(id, "TRN_RANK");
  } else if (auto orank = read_int<int>(env, "OMPI_COMM_WORLD_RANK")) {
    id.source = IdentitySource::kOpenMpi;
    id.rank = *orank;
    id.world_size = required_int<int>(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK");
    id.local_rank = read_int<int>(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
    id.local_world_size = read_int<int>(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(1);
    check(id, "OMPI_COMM_WORLD_RANK");
    id.node_rank = id.rank / id.local_world_size;
    if (auto job = env("OMPI_MCA_ess_base_jobid")) id.job_id = "ompi-" + *job;
  } else if (auto procid = read_int<int>(env, "SLURM_PROCID"); procid && env("SLURM_NTASKS")) {
    id.source = IdentitySource::kSlurm;
    id.rank = *procid;
    id.world_size = required_int<int>(env, "SLURM_NTASKS", "SLURM_PROCID");
    id.local_rank = read_int<int>(env, "SLURM_LOCALID").value_or(0);
    id.node_rank = read_int<int>(env, "SLURM_NODEID").value_or(0);
    if (auto per_node = read_int<int>(env, "SLURM_NTASKS_PER_NODE")) {
      id.local_world_size = *per_node;
    } else if (auto spec = env("SLURM_TASKS_PER_NODE")) {
      auto n = slurm_tasks_on_node(*spec, id.node_rank);
      if (!n) throw usage_error("SLURM_TASKS_PER_NODE={} does not describe node {}", *spec, id.node_rank);
      id.local_world_size = *n;
    } else {
      id.local_world_size = id.local_rank + 1;
    }
    check(id, "SLURM_PROCID");
    if (auto job = env("SLURM_JOB_ID")) {
      id.job_id = "slurm-" + *job;
      if (auto step = env("SLURM_STEP_ID")) id.job_id += "." + *step;
    }
  }
  id.generation = read_int<int64_t>(env, "TRN_GENERATION").value_or(0);
  if (auto job = env("TRN_JOB_ID"); job && !job->empty()) id.job_id = *job;
  if (auto c = env("TRN_COORDINATOR")) id.coordinator = *c;
  if (auto t = env("TRN_TOKEN_FILE")) id.token_file = *t;
  if (auto t = env("TRN_TLS_CA")) id.tls_ca = *t;
  if (auto t = env("TRN_TLS_CERT")) id.tls_cert = *t;
  if (auto t = env("TRN_TLS_KEY")) id.tls_key = *t;
  return id;
}

WorkerIdentity identity_from_environment() {
  EnvLookup getenv_lookup = process_env();
  return identity_from([&](const std::string& name) -> std::optional<std::string> {
    if (name.rfind("TRN_", 0) == 0) {
      if (!settings::is_set(name)) return std::nullopt;
      return settings::get(name);
    }
    return getenv_lookup(name);
  });
}

std::map<std::string, std::string> worker_env_vars(const WorkerIdentity& id) {
  std::map<std::string, std::string> env = {
      {"TRN_RANK", std::to_string(id.rank)},
      {"TRN_LOCAL_RANK", std::to_string(id.local_rank)},
      {"TRN_WORLD_SIZE", std::to_string(id.world_size)},
      {"TRN_LOCAL_WORLD_SIZE", std::to_string(id.local_world_size)},
      {"TRN_NODE_RANK", std::to_string(id.node_rank)},
      {"TRN_GENERATION", std::to_string(id.generation)},
      {"TRN_JOB_ID", id.job_id},
      {"TRN_COORDINATOR", id.coordinator},
  };
  if (!id.token_file.empty()) env["TRN_TOKEN_FILE"] = id.token_file;
  if (!id.tls_ca.empty()) env["TRN_TLS_CA"] = id.tls_ca;
  if (!id.tls_cert.empty()) env["TRN_TLS_CERT"] = id.tls_cert;
  if (!id.tls_key.empty()) env["TRN_TLS_KEY"] = id.tls_key;
  return env;
}

}  // namespace trn::launch
