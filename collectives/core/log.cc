#include "collectives/core/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

namespace trn::log {
namespace {

std::atomic<int> g_rank{-1};
std::atomic<int64_t> g_generation{-1};

struct Config {
  spdlog::level::level_enum level = spdlog::level::info;
  bool subsys_on[static_cast<int>(Subsys::kCount)] = {};
  std::string host;
  std::shared_ptr<spdlog::logger> logger;
};

spdlog::level::level_enum parse_level(const std::string& v) {
  if (v == "trace") return spdlog::level::trace;
  if (v == "debug") return spdlog::level::debug;
  if (v == "info") return spdlog::level::info;
  if (v == "warn" || v == "warning") return spdlog::level::warn;
  if (v == "error") return spdlog::level::err;
  if (v == "off") return spdlog::level::off;
  throw usage_error("TRN_LOG_LEVEL={} is not a level; use trace, debug, info, warn, error or off", v);
}

Config make_config() {
  Config c;
  c.level = parse_level(settings::get("TRN_LOG_LEVEL"));
  std::string subsys = settings::get("TRN_LOG_SUBSYS");
  bool any_positive = false;
  std::stringstream ss(subsys);
  std::string item;
  std::vector<std::pair<std::string, bool>> items;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    bool exclude = item[0] == '^';
    if (exclude) item = item.substr(1);
    items.emplace_back(item, !exclude);
    any_positive |= !exclude;
  }
  for (auto& on : c.subsys_on) on = !any_positive;
  for (auto& [name, on] : items) {
    bool matched = false;
    for (int i = 0; i < static_cast<int>(Subsys::kCount); ++i) {
      if (name == "all" || name == to_string(static_cast<Subsys>(i))) {
        c.subsys_on[i] = on;
        matched = true;
      }
    }
    if (!matched)
      throw usage_error("TRN_LOG_SUBSYS names unknown subsystem '{}'; use init,fabric,coll,coord,train,launch", name);
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  c.host = host;
  c.logger = std::make_shared<spdlog::logger>("trn", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  c.logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %^%l%$ %v");
  c.logger->set_level(spdlog::level::trace);
  return c;
}

const Config& config() {
  static const Config c = [] {
    try {
      return make_config();
    } catch (const Error& e) {
      // A bad logging setting must not stop the program from reporting it.
      fmt::print(stderr, "trn: {}\n", e.what());
      std::exit(2);
    }
  }();
  return c;
}

}  // namespace

const char* to_string(Subsys s) {
  switch (s) {
    case Subsys::kInit: return "init";
    case Subsys::kFabric: return "fabric";
    case Subsys::kColl: return "coll";
    case Subsys::kCoord: return "coord";
    case Subsys::kTrain: return "train";
    case Subsys::kLaunch: return "launch";
    case Subsys::kCount: break;
  }
  return "?";
}

void set_rank(int rank) { g_rank = rank; }
void set_generation(int64_t generation) { g_generation = generation; }

bool enabled(Subsys s, spdlog::level::level_enum level) {
  const Config& c = config();
  if (level < c.level) return false;
  if (level >= spdlog::level::warn) return true;
  return c.subsys_on[static_cast<int>(s)];
}

void write(Subsys s, spdlog::level::level_enum level, const std::string& message) {
  const Config& c = config();
  int rank = g_rank.load();
  int64_t gen = g_generation.load();
  std::string r = rank < 0 ? "-" : std::to_string(rank);
  std::string g = gen < 0 ? "-" : std::to_string(gen);
  c.logger->log(level, "[{}:{} r{} g{} {}] {}", c.host, getpid(), r, g, to_string(s), message);
}

}  // namespace trn::log
