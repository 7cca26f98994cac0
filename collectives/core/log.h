// Logging: one line per event on stderr, prefixed with host, pid, rank, generation and
// subsystem. TRN_LOG_LEVEL sets the level; TRN_LOG_SUBSYS picks which subsystems print info and
// debug lines (warnings and errors always print).
//
//   trn::log::info(trn::log::Subsys::kFabric, "provider {} selected", name);
#pragma once

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdint>
#include <string>

namespace trn::log {

enum class Subsys { kInit, kFabric, kColl, kCoord, kTrain, kLaunch, kCount };

const char* to_string(Subsys s);

// Identity shown in the prefix; -1 shows as "-".
void set_rank(int rank);
void set_generation(int64_t generation);

// True when a line of this level from this subsystem would print.
bool enabled(Subsys s, spdlog::level::level_enum level);

// Writes one line (already checked with enabled()).
void write(Subsys s, spdlog::level::level_enum level, const std::string& message);

template <typename... Args>
void emit(Subsys s, spdlog::level::level_enum level, fmt::format_string<Args...> f, Args&&... args) {
  if (enabled(s, level)) write(s, level, fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
void trace(Subsys s, fmt::format_string<Args...> f, Args&&... args) {
  emit(s, spdlog::level::trace, f, std::forward<Args>(args)...);
}
template <typename... Args>
void debug(Subsys s, fmt::format_string<Args...> f, Args&&... args) {
  emit(s, spdlog::level::debug, f, std::forward<Args>(args)...);
}
template <typename... Args>
void info(Subsys s, fmt::format_string<Args...> f, Args&&... args) {
  emit(s, spdlog::level::info, f, std::forward<Args>(args)...);
}
template <typename... Args>
void warn(Subsys s, fmt::format_string<Args...> f, Args&&... args) {
  emit(s, spdlog::level::warn, f, std::forward<Args>(args)...);
}
template <typename... Args>
void error(Subsys s, fmt::format_string<Args...> f, Args&&... args) {
  emit(s, spdlog::level::err, f, std::forward<Args>(args)...);
}

}  // namespace trn::log
