#include "collectives/core/flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <map>
#include <type_traits>

#include "collectives/core/error.h"

namespace trn::flags {
namespace {

std::vector<std::string> split_choices(const std::string& choices) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= choices.size()) {
    const size_t bar = choices.find('|', start);
    out.push_back(choices.substr(start, bar == std::string::npos ? std::string::npos : bar - start));
    if (bar == std::string::npos) break;
    start = bar + 1;
  }
  return out;
}

// "a", "a or b", "a, b or c"
std::string or_list(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? " or " : ", ";
    out += items[i];
  }
  return out;
}

template <typename T>
T number(const Flag& f, const std::string& v) {
  T out{};
  const char* end = v.data() + v.size();
  auto [p, ec] = std::from_chars(v.data(), end, out);
  if (ec != std::errc() || p != end) throw usage_error("{} needs a number, got '{}'", f.name, v);
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(out)) throw usage_error("{} needs a finite number, got '{}'", f.name, v);
  switch (f.range) {
    case Range::kAny:
      break;
    case Range::kPositive:
      if (!(out > 0)) throw usage_error("{} must be positive, got {}", f.name, v);
      break;
    case Range::kNonNegative:
      if (out < 0) throw usage_error("{} must not be negative, got {}", f.name, v);
      break;
    case Range::kMinMax:
      if (static_cast<double>(out) < f.min) throw usage_error("{} must be at least {}, got {}", f.name, f.min, v);
      if (static_cast<double>(out) > f.max) throw usage_error("{} must be at most {}, got {}", f.name, f.max, v);
      break;
  }
  return out;
}

void check_choice(const Flag& f, const std::string& v) {
  const auto choices = split_choices(f.choices);
  for (const auto& c : choices)
    if (c == v) return;
  throw usage_error("{} takes {}{}, got '{}'", f.name, or_list(choices),
                    *f.choices_note ? fmt::format(" ({})", f.choices_note) : "", v);
}

void set(const Flag& f, const std::string& v) {
  if (*f.choices) check_choice(f, v);
  void* m = f.target.member();
  switch (f.target.kind()) {
    case Kind::kInt: *static_cast<int*>(m) = number<int>(f, v); break;
    case Kind::kInt64: *static_cast<int64_t*>(m) = number<int64_t>(f, v); break;
    case Kind::kUint64: *static_cast<uint64_t*>(m) = number<uint64_t>(f, v); break;
    case Kind::kFloat: *static_cast<float*>(m) = number<float>(f, v); break;
    case Kind::kDouble: *static_cast<double*>(m) = number<double>(f, v); break;
    case Kind::kString:
    case Kind::kChoice:
      if (f.target.parser()) {
        f.target.parser()(f.name, v);
      } else {
        *static_cast<std::string*>(m) = v;
      }
      break;
    case Kind::kSwitch: *static_cast<bool*>(m) = true; break;
  }
  if (f.then) f.then(f.name, v);
}

std::string value_name(const Flag& f) {
  if (*f.value_name) return f.value_name;
  if (*f.choices) return f.choices;
  switch (kind_of(f)) {
    case Kind::kInt:
    case Kind::kInt64:
    case Kind::kUint64:
      return "N";
    case Kind::kFloat:
    case Kind::kDouble:
      return "X";
    case Kind::kString:
    case Kind::kChoice:
      return "VALUE";
    case Kind::kSwitch:
      return "";
  }
  return "";
}

std::string default_text(const Flag& f) {
  if (f.default_text) return f.default_text;
  const void* m = f.target.member();
  switch (f.target.kind()) {
    case Kind::kInt: return fmt::format("{}", *static_cast<const int*>(m));
    case Kind::kInt64: return fmt::format("{}", *static_cast<const int64_t*>(m));
    case Kind::kUint64: return fmt::format("{}", *static_cast<const uint64_t*>(m));
    case Kind::kFloat: return fmt::format("{}", *static_cast<const float*>(m));
    case Kind::kDouble: return fmt::format("{}", *static_cast<const double*>(m));
    case Kind::kString:
    case Kind::kChoice: return m ? *static_cast<const std::string*>(m) : "";
    case Kind::kSwitch: return "";
  }
  return "";
}

// Appends text wrapped to `width` columns, continuation lines indented by `indent`.
void wrap(std::string* out, const std::string& text, size_t column, size_t indent, size_t width) {
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    const size_t word = end - start;
    if (column > indent && column + 1 + word > width) {
      *out += "\n" + std::string(indent, ' ');
      column = indent;
    } else if (column > indent) {
      *out += ' ';
      ++column;
    }
    out->append(text, start, word);
    column += word;
    start = end + 1;
  }
}

}  // namespace

Kind kind_of(const Flag& f) {
  const Kind k = f.target.kind();
  return *f.choices && k != Kind::kSwitch ? Kind::kChoice : k;
}

bool parse(const Table& table, const std::vector<std::string>& args, std::set<std::string>* given) {
  std::map<std::string, const Flag*> by_name;
  for (const auto& f : table.flags) by_name[f.name] = &f;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    if (name == "-h" || name == "--help") {
      std::fputs(help(table).c_str(), stdout);
      return false;
    }
    const auto eq = name.find('=');
    const bool inline_value = name.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto it = by_name.find(name);
    // A switch takes no value, so "--switch=x" names no flag the program has.
    if (it == by_name.end() || (inline_value && kind_of(*it->second) == Kind::kSwitch))
      throw usage_error("unknown option '{}'; run {} --help for the list", name, table.program);
    const Flag& f = *it->second;
    if (kind_of(f) != Kind::kSwitch && !inline_value) {
      if (i + 1 >= args.size()) throw usage_error("{} needs a value", name);
      value = args[++i];
    }
    set(f, value);
    if (given) given->insert(name);
  }
  return true;
}

std::string help(const Table& table) {
  constexpr size_t kWidth = 100, kHelpColumn = 32;
  std::string out = fmt::format("usage: {} [options]\n{}", table.program, table.summary);
  if (!out.empty() && out.back() != '\n') out += '\n';
  std::vector<std::string> groups;
  for (const auto& f : table.flags)
    if (std::find(groups.begin(), groups.end(), f.group) == groups.end()) groups.push_back(f.group);
  for (const auto& g : groups) {
    out += g.empty() ? "\n" : fmt::format("\n{}:\n", g);
    for (const auto& f : table.flags) {
      if (f.group != g) continue;
      std::string entry = fmt::format("  {}", f.name);
      if (const auto v = value_name(f); !v.empty()) entry += " " + v;
      if (const auto d = default_text(f); !d.empty()) entry += " (" + d + ")";
      if (entry.size() + 1 > kHelpColumn) {
        out += entry + "\n" + std::string(kHelpColumn, ' ');
      } else {
        out += entry + std::string(kHelpColumn - entry.size(), ' ');
      }
      wrap(&out, f.help, kHelpColumn, kHelpColumn, kWidth);
      out += '\n';
    }
  }
  return out;
}

}  // namespace trn::flags
