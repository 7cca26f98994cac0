// The registry of every TRN_* environment setting, with its default and meaning. Values are read
// from the environment once, on first use; each value that overrides its default is logged once
// ("TRN_X set by environment to Y"). Asking for a name that is not registered is a bug.
//
// To add a setting: add a row to the table in settings.cc and a line to the README's table.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/core/deadline.h"

namespace trn::settings {

struct Setting {
  const char* name;
  const char* default_value;  // "" means unset
  const char* help;
};

// Every registered setting, in table order.
const std::vector<Setting>& all();

// The value of a setting: the environment's if set, else the default.
std::string get(std::string_view name);
// True when the environment set it (even to the default value).
bool is_set(std::string_view name);

// Typed views; a value that does not parse is a usage error naming the variable.
int64_t get_int(std::string_view name);
double get_double(std::string_view name);
bool get_bool(std::string_view name);  // 1/0, true/false, yes/no, on/off
Duration get_seconds(std::string_view name);  // decimal seconds

// Forgets cached values so the next get() re-reads the environment (tests only).
void reload_for_testing();

}  // namespace trn::settings
