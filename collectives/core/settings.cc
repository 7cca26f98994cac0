#include "collectives/core/settings.h"

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::settings {
namespace {

constexpr double kNoMax = 0;  // max 0: no upper bound
constexpr double kMaxSeconds = 1e7;  // any longer is a typo, and overflows a deadline

const std::vector<Setting> kSettings = {
    // Logging
    {"TRN_LOG_LEVEL", "info", "trace|debug|info|warn|error|off", Type::kChoice, 0, 0, false,
     "trace|debug|info|warn|warning|error|off"},
    {"TRN_LOG_SUBSYS", "all",
     "comma list of subsystems whose info/debug lines print: init,fabric,coll,coord,train,launch "
     "(warnings and errors always print); prefix one with ^ to exclude it"},
    // Timeouts
    {"TRN_TIMEOUT", "300", "seconds any blocking wait (fabric, store, collective) may take", Type::kSeconds, 0,
     kMaxSeconds, true},
    // Fabric
    {"TRN_FABRIC_PROVIDER", "auto", "auto|efa|tcp|udp|shm|sockets (auto: efa when present, else tcp;ofi_rxm; "
                                    "udp: udp;ofi_rxd)",
     Type::kChoice, 0, 0, false, "auto|efa|tcp|udp|shm|sockets"},
    {"TRN_FABRIC_SHM", "", "1/0: use the shm provider for peers on the same host (default: on when "
                           "several ranks share a host)", Type::kBool},
    {"TRN_FABRIC_IFACE", "", "network interface/address the tcp provider binds (default: provider's choice)"},
    {"TRN_FABRIC_RAILS", "", "the NICs (rails) each rank's fabric uses: auto (every EFA device; one elsewhere), a "
                             "count (the provider's first N), or interface/device names (eth0,eth1); default one"},
    {"TRN_FABRIC_STRIPE_MIN", "262144", "bytes from which a message to another host is striped over every rail",
     Type::kInt, 4096, 1e15},
    {"TRN_FABRIC_SPIN_US", "10", "microseconds a fabric wait polls before it yields, then sleeps (unset: 10, or 0 when "
                                 "the host has more ranks than processors)", Type::kNumber, 0, 1e9},
    {"TRN_FABRIC_YIELD_US", "500", "microseconds a fabric wait then polls, yielding the core between polls, before it sleeps",
     Type::kNumber, 0, 1e9},
    {"TRN_FABRIC_RING", "1", "1/0: trn's shared-memory rings for same-host peers reached through shm", Type::kBool},
    {"TRN_FABRIC_RING_EAGER", "262144", "bytes up to which a message travels inside a shared-memory ring",
     Type::kInt, 0, 1 << 20},
    {"TRN_FABRIC_PULL", "1", "1/0: same-host receivers copy long messages from the sender's memory (process_vm_readv)",
     Type::kBool},
    {"TRN_FABRIC_MR_LOCAL", "0", "1: register every buffer with the provider as EFA requires (FI_MR_LOCAL), on any "
                                 "provider", Type::kBool},
    // Collectives
    {"TRN_ALGO", "auto", "all-reduce algorithm: ring|tree|rhd|hier|auto", Type::kChoice, 0, 0, false,
     "ring|tree|rhd|hier|auto"},
    {"TRN_A2A_ALGO", "auto", "all_to_all_v algorithm: pairwise|direct|auto", Type::kChoice, 0, 0, false,
     "pairwise|direct|auto"},
    {"TRN_COLL_POLL_US", "200", "microseconds the engine thread (not in blocking style) and a waiting caller poll (yielding "
     "the core) before they sleep",
     Type::kNumber, 0, 1e9},
    {"TRN_CHECK_COLLECTIVES", "0", "1: check that all ranks call the same collective (op, count, dtype, root)",
     Type::kBool},
    // Process identity (set by trnrun, or read from Slurm/Open MPI)
    {"TRN_RANK", "", "global rank of this worker", Type::kInt, 0, kNoMax},
    {"TRN_LOCAL_RANK", "", "rank of this worker on its node", Type::kInt, 0, kNoMax},
    {"TRN_WORLD_SIZE", "", "number of workers in the job", Type::kInt, 1, kNoMax},
    {"TRN_LOCAL_WORLD_SIZE", "", "number of workers on this node", Type::kInt, 1, kNoMax},
    {"TRN_NODE_RANK", "", "rank of this node", Type::kInt, 0, kNoMax},
    {"TRN_GENERATION", "0", "job generation this worker belongs to", Type::kInt, 0, kNoMax},
    // Control plane
    {"TRN_COORDINATOR", "", "HOST:PORT of the trn-coordinator"},
    {"TRN_JOB_ID", "", "job id at the coordinator"},
    {"TRN_TOKEN_FILE", "", "file holding the bearer token for the coordinator"},
    {"TRN_TLS_CA", "", "PEM of the CA that signed the coordinator's certificate: connect with TLS"},
    {"TRN_TLS_CERT", "", "PEM client certificate for the coordinator's mTLS (with TRN_TLS_KEY)"},
    {"TRN_TLS_KEY", "", "PEM key of TRN_TLS_CERT"},
    {"TRN_RECOVERY", "restart",
     "restart|in-place: what this worker's trnrun does when a worker fails (set by trnrun --recovery); in-place: "
     "survivors keep running, abort at once and rebuild in the generation the agent's resume names",
     Type::kChoice, 0, 0, false, "restart|in-place"},
    {"TRN_HEARTBEAT_INTERVAL", "1", "seconds between worker heartbeats", Type::kSeconds, 0, kMaxSeconds, true},
    {"TRN_HEARTBEAT_DATAGRAMS", "on",
     "on|off: trnrun sends its node heartbeats as UDP datagrams when the coordinator takes them (gRPC when one "
     "goes unanswered); off: gRPC only",
     Type::kChoice, 0, 0, false, "on|off"},
    {"TRN_STORE_DIR", "", "shared directory used as the bootstrap store when there is no coordinator"},
    // Runtime
    {"TRN_THREADS", "", "compute threads per worker (default: trn-train --threads, else 1)", Type::kInt, 1, 4096},
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

namespace {

// What a setting takes, for its error message: "an integer from 0 to 1048576".
std::string expectation(const Setting& s) {
  if (s.type == Type::kBool) return "1 or 0";
  if (s.type == Type::kChoice) return fmt::format("one of {}", s.choices);
  const char* what = s.type == Type::kInt ? "an integer" : s.type == Type::kSeconds ? "a number of seconds" : "a number";
  std::string range = s.min_exclusive ? fmt::format(" greater than {}", s.min) : fmt::format(" of at least {}", s.min);
  if (s.max != kNoMax) {
    range = s.min_exclusive ? fmt::format(" greater than {} and at most {}", s.min, s.max)
                            : fmt::format(" from {} to {}", s.min, s.max);
  }
  return what + range;
}

bool parse_bool(const std::string& v, bool* out) {
  if (v == "1" || v == "true" || v == "yes" || v == "on") return *out = true, true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return *out = false, true;
  return false;
}

}  // namespace

void check(const Setting& s, const std::string& v) {
  if (s.type == Type::kText || (v.empty() && !*s.default_value)) return;
  bool ok = true;
  if (s.type == Type::kBool) {
    bool b;
    ok = parse_bool(v, &b);
  } else if (s.type == Type::kChoice) {
    ok = false;
    std::string_view rest = s.choices;
    while (!ok && !rest.empty()) {
      const size_t bar = rest.find('|');
      ok = rest.substr(0, bar) == v;
      rest = bar == std::string_view::npos ? "" : rest.substr(bar + 1);
    }
  } else {
    char* end = nullptr;
    errno = 0;
    double x = 0;
    if (s.type == Type::kInt) x = static_cast<double>(std::strtoll(v.c_str(), &end, 10));
    else x = std::strtod(v.c_str(), &end);
    ok = !v.empty() && *end == '\0' && errno != ERANGE && std::isfinite(x) &&
         (s.min_exclusive ? x > s.min : x >= s.min) && (s.max == kNoMax || x <= s.max);
  }
  if (!ok)
    throw usage_error("{}={} is not valid: use {}{}", s.name, v, expectation(s),
                      *s.default_value ? fmt::format(" (default {})", s.default_value) : std::string());
}

void validate() {
  for (const auto& s : kSettings)
    if (const char* env = std::getenv(s.name)) check(s, env);
}

int64_t get_int(std::string_view name) {
  const Setting& s = find(name);
  std::string v = get(name);
  if (s.type != Type::kText) check(s, v);
  char* end = nullptr;
  long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0') throw usage_error("{}={} is not an integer", name, v);
  return x;
}

double get_double(std::string_view name) {
  const Setting& s = find(name);
  std::string v = get(name);
  if (s.type != Type::kText) check(s, v);
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0') throw usage_error("{}={} is not a number", name, v);
  return x;
}

bool get_bool(std::string_view name) {
  const Setting& s = find(name);
  std::string v = get(name);
  if (s.type != Type::kText) check(s, v);
  bool b = false;
  if (v.empty() || parse_bool(v, &b)) return b;
  throw usage_error("{}={} is not a boolean (use 1 or 0)", name, v);
}

Duration get_seconds(std::string_view name) {
  double s = get_double(name);
  if (s < 0 || !std::isfinite(s)) throw usage_error("{}={} must be a number of seconds", name, s);
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
