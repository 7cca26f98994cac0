// Reading environment variables through a function, so the code that interprets them (Slurm and
// Open MPI pickup, worker identity) is unit-testable without touching the process environment.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>

namespace trn::launch {

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// The process environment (getenv).
EnvLookup process_env();
// A fixed map (tests).
EnvLookup map_env(std::map<std::string, std::string> values);

}  // namespace trn::launch
