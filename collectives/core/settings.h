// The registry of every TRN_* environment setting, with its default and meaning. Values are read
// from the environment once, on first use; each value that overrides its default is logged once
// ("TRN_X set by environment to Y"). Asking for a name that is not registered is a bug.
//
// Every row says what values the setting takes (a type and, for numbers, a range; or a list of
// choices), and that is checked in one place: a value outside it is one usage error naming the
// variable, the value and what it takes, whether a typed getter reads it or validate() checks the
// whole environment up front (run_main does, so a bad value ends a program before it starts).
//
// To add a setting: add a row to the table in settings.cc and a line to docs/environment.md's table.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "collectives/core/deadline.h"

namespace trn::settings {

enum class Type { kText, kBool, kInt, kNumber, kSeconds, kChoice };

struct Setting {
  const char* name;
  const char* default_value;  // "" means unset (an empty value then counts as unset too)
  const char* help;
  Type type = Type::kText;
  double min = 0, max = 0;  // kInt, kNumber, kSeconds: the range; min_exclusive: more than min
  bool min_exclusive = false;
  const char* choices = "";  // kChoice: "a|b|c"
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

// Checks value against what the setting takes; a usage error naming it when it does not fit.
void check(const Setting& s, const std::string& value);
// Checks every registered setting the environment sets (the first bad one throws).
void validate();

// Forgets cached values so the next get() re-reads the environment (tests only).
void reload_for_testing();

}  // namespace trn::settings
