#include "collectives/core/settings.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::settings {
namespace {

const std::vector<Setting> kSettings = {
    // Logging
    {"TRN_LOG_LEVEL", "info", "trace|debug|info|warn|error|off"},
    {"TRN_LOG_SUBSYS", "all",
     "comma list of subsystems whose info/debug lines print: init,fabric,coll,coord,train,launch "
     "(warnings and errors always print); prefix one with ^ to exclude it"},
    // Timeouts
    {"TRN_TIMEOUT", "300", "seconds any blocking wait (fabric, store, collective) may take"},
    // Fabric
    {"TRN_FABRIC_PROVIDER", "auto", "auto|efa|tcp|shm|sockets (auto: efa when present, else tcp;ofi_rxm)"},
    {"TRN_FABRIC_SHM", "", "1/0: use the shm provider for peers on the same host (default: on when "
                           "several ranks share a host)"},
    {"TRN_FABRIC_IFACE", "", "network interface/address the tcp provider binds (default: provider's choice)"},
    {"TRN_FABRIC_SPIN_US", "10", "microseconds a fabric wait polls before it yields, then sleeps (unset: 10, or 0 when "
                                 "the host has more ranks than processors)"},
    {"TRN_FABRIC_YIELD_US", "500", "microseconds a fabric wait then polls, yielding the core between polls, before it sleeps"},
    {"TRN_FABRIC_RING", "1", "1/0: trn's shared-memory rings for same-host peers reached through shm"},
    {"TRN_FABRIC_RING_EAGER", "262144", "bytes up to which a message travels inside a shared-memory ring"},
    {"TRN_FABRIC_PULL", "1", "1/0: same-host receivers copy long messages from the sender's memory (process_vm_readv)"},
    // Collectives
    {"TRN_ALGO", "auto", "all-reduce algorithm: ring|tree|rhd|auto"},
    {"TRN_COLL_POLL_US", "200", "microseconds the engine thread and a waiting caller poll (yielding the core) before they sleep"},
    {"TRN_CHECK_COLLECTIVES", "0", "1: check that all ranks call the same collective (op, count, dtype, root)"},
    // Process identity (set by trnrun, or read from Slurm/Open MPI)
    {"TRN_RANK", "", "global rank of this worker"},
    {"TRN_LOCAL_RANK", "", "rank of this worker on its node"},
    {"TRN_WORLD_SIZE", "", "number of workers in the job"},
    {"TRN_LOCAL_WORLD_SIZE", "", "number of workers on this node"},
    {"TRN_NODE_RANK", "", "rank of this node"},
    {"TRN_GENERATION", "0", "job generation this worker belongs to"},
    // Control plane
    {"TRN_COORDINATOR", "", "HOST:PORT of the trn-coordinator"},
    {"TRN_JOB_ID", "", "job id at the coordinator"},
    {"TRN_TOKEN_FILE", "", "file holding the bearer token for the coordinator"},
    {"TRN_HEARTBEAT_INTERVAL", "1", "seconds between worker heartbeats"},
    {"TRN_STORE_DIR", "", "shared directory used as the bootstrap store when there is no coordinator"},
    // Runtime
    {"TRN_THREADS", "", "compute threads per worker (default: trn-train --threads, else 1)"},
};

struct Cache {
  std::mutex mu;
  std::map<std::string, std::string, std::less<>> values;
  std::map<std::string, bool, std::less<>> from_env;
  bool loaded = false;
};

Cache& cache() {
  static Cache c;
  return c;
}

const Setting& find(std::string_view name) {
  for (const auto& s : kSettings)
    if (name == s.name) return s;
  throw internal_error("setting {} is not registered in collectives/core/settings.cc", name);
}

void load_locked(Cache& c) {
  if (c.loaded) return;
  for (const auto& s : kSettings) {
    const char* env = std::getenv(s.name);
    c.values[s.name] = env ? env : s.default_value;
    c.from_env[s.name] = env != nullptr;
  }
  c.loaded = true;
}

}  // namespace

const std::vector<Setting>& all() { return kSettings; }

std::string get(std::string_view name) {
  const Setting& s = find(name);
  Cache& c = cache();
  std::string value;
  bool log_override = false;
  {
    std::lock_guard lock(c.mu);
    load_locked(c);
    value = c.values.find(name)->second;
    auto it = c.from_env.find(name);
    if (it->second && value != s.default_value) {
      log_override = true;
      it->second = false;  // log once
    }
  }
  // TRN_LOG_* are read while the logger is being set up; the logger reports those itself.
  // Knobs with a default are logged at info; identity handed over by a launcher (no default:
  // TRN_RANK, TRN_JOB_ID, ...) at debug, so a job's first lines are not a wall of ranks.
  if (log_override && name.substr(0, 8) != "TRN_LOG_") {
    if (*s.default_value)
      log::info(log::Subsys::kInit, "{} set by environment to {}", name, value);
    else
      log::debug(log::Subsys::kInit, "{} set by environment to {}", name, value);
  }
  return value;
}

bool is_set(std::string_view name) {
  find(name);
  return std::getenv(std::string(name).c_str()) != nullptr;
}

int64_t get_int(std::string_view name) {
  std::string v = get(name);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') throw usage_error("{}={} is not an integer", name, v);
  return x;
}

double get_double(std::string_view name) {
  std::string v = get(name);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0') throw usage_error("{}={} is not a number", name, v);
  return x;
}

bool get_bool(std::string_view name) {
  std::string v = get(name);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  throw usage_error("{}={} is not a boolean (use 1 or 0)", name, v);
}

Duration get_seconds(std::string_view name) {
  double s = get_double(name);
  if (s < 0) throw usage_error("{}={} must not be negative", name, s);
  return std::chrono::duration_cast<Duration>(std::chrono::duration<double>(s));
}

// TRN_TIMEOUT in nanoseconds once parsed (every blocking wait asks for it); -1: not yet.
std::atomic<int64_t> g_timeout_ns{-1};

void reload_for_testing() {
  g_timeout_ns.store(-1);
  Cache& c = cache();
  std::lock_guard lock(c.mu);
  c.values.clear();
  c.from_env.clear();
  c.loaded = false;
}

}  // namespace trn::settings

namespace trn {

Duration default_timeout() {
  int64_t ns = settings::g_timeout_ns.load(std::memory_order_relaxed);
  if (ns < 0) {
    ns = std::chrono::duration_cast<std::chrono::nanoseconds>(settings::get_seconds("TRN_TIMEOUT")).count();
    settings::g_timeout_ns.store(ns, std::memory_order_relaxed);
  }
  return std::chrono::duration_cast<Duration>(std::chrono::nanoseconds(ns));
}
Deadline Deadline::from_default_timeout() { return Deadline::after(default_timeout()); }

}  // namespace trn
