#include "runtime/util/trace.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace trn::trace {
namespace {

std::atomic<bool> g_on{false};
int g_rank = 0;
std::mutex g_mu;
std::string g_events;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void enable(int rank) {
  g_rank = rank;
  g_on.store(true);
}

bool enabled() { return g_on.load(std::memory_order_relaxed); }

std::string events_json() {
  std::lock_guard lock(g_mu);
  return g_events;
}

Span::Span(const char* name, const char* category, std::vector<std::pair<const char*, int64_t>> args)
    : name_(name), category_(category), args_(std::move(args)) {
  if (enabled()) start_us_ = now_us();
}

Span::~Span() {
  if (start_us_ < 0) return;
  const int64_t end = now_us();
  std::string args;
  for (const auto& [k, v] : args_) args += fmt::format("{}\"{}\":{}", args.empty() ? "" : ",", k, v);
  const auto tid = std::hash<std::thread::id>{}(std::this_thread::get_id()) % 1000;
  std::string e = fmt::format(
      "{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{},\"dur\":{},\"pid\":{},\"tid\":{},\"args\":{{{}}}}}", name_,
      category_, start_us_, end - start_us_, g_rank, tid, args);
  std::lock_guard lock(g_mu);
  if (!g_events.empty()) g_events += ",\n";
  g_events += e;
}

}  // namespace trn::trace
