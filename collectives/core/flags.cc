#include "collectives/core/flags.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <type_traits>

#include "collectives/core/error.h"

namespace trn::flags {

template <typename T>
std::optional<T> to_number(const std::string& text) {
  T out{};
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, out);
  if (ec != std::errc() || p != end) return std::nullopt;
  return out;
}

template std::optional<int> to_number<int>(const std::string&);
template std::optional<int64_t> to_number<int64_t>(const std::string&);
template std::optional<uint64_t> to_number<uint64_t>(const std::string&);
template std::optional<float> to_number<float>(const std::string&);
template std::optional<double> to_number<double>(const std::string&);

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

// The error lines of one table's wording (Style) for the flag f given the value v: "--x v: what"
// (kColon) or "--x what, got 'v'" (kGot); a row's `invalid` text stands for all of them.
class Lines {
 public:
  Lines(Style style, const Flag& f, const std::string& v) : colon_(style == Style::kColon), f_(f), v_(v) {}

  [[noreturn]] void not_a_number(bool integral) const {
    if (colon_) fail(integral ? "expected an integer" : "expected a number");
    fail("needs a number");
  }
  [[noreturn]] void not_finite() const { fail(colon_ ? "expected a finite number" : "needs a finite number"); }
  [[noreturn]] void not_a_size() const {
    fail(colon_ ? "not a size (use a number with an optional K, M or G suffix, e.g. 64M)"
                : "needs a size (a number with an optional K, M or G suffix, e.g. 64M)");
  }
  // kGot words a number out of range without quotes: "--dp must be positive, got 0".
  [[noreturn]] void out_of_range(const std::string& what) const {
    check_invalid();
    if (colon_) throw usage_error("{} {}: {}", f_.name, v_, what);
    throw usage_error("{} {}, got {}", f_.name, what, v_);
  }
  [[noreturn]] void not_a_choice(const std::vector<std::string>& choices) const {
    check_invalid();
    throw usage_error("{} takes {}{}, got '{}'", f_.name, or_list(choices),
                      *f_.choices_note ? fmt::format(" ({})", f_.choices_note) : "", v_);
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    check_invalid();
    if (colon_) throw usage_error("{} {}: {}", f_.name, v_, what);
    throw usage_error("{} {}, got '{}'", f_.name, what, v_);
  }
  void check_invalid() const {
    if (*f_.invalid) throw usage_error("{} {}: {}", f_.name, v_, f_.invalid);
  }

  bool colon_;
  const Flag& f_;
  const std::string& v_;
};

void check_range(const Flag& f, const Lines& lines, double x) {
  const bool low = f.range == Range::kMinMax || f.range == Range::kAtLeast;
  const bool high = f.range == Range::kMinMax || f.range == Range::kPositiveAtMost;
  if ((f.range == Range::kPositive || f.range == Range::kPositiveAtMost) && !(x > 0))
    lines.out_of_range("must be positive");
  if (f.range == Range::kNonNegative && x < 0) lines.out_of_range("must not be negative");
  if (low && x < f.min) lines.out_of_range(fmt::format("must be at least {}", f.min));
  if (high && x > f.max) lines.out_of_range(fmt::format("must be at most {}", f.max));
}

// Which side of T's range text lies past when it is a number T cannot hold: +1 above T's
// largest, -1 below its lowest (a negative number for an unsigned T), 0 when it is no number at
// all (or a float too close to 0 for T, which stays "not a number").
template <typename T>
int past_range(const std::string& text) {
  const bool negative = !text.empty() && text[0] == '-';
  if constexpr (std::is_unsigned_v<T>) {
    if (negative && to_number<int64_t>(text)) return -1;
    if (negative) return past_range<int64_t>(text) != 0 ? -1 : 0;
  }
  T out{};
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, out);
  if (ec != std::errc::result_out_of_range || p != end) return 0;
  if constexpr (std::is_floating_point_v<T>) {
    // from_chars says out of range for an underflow too: only a magnitude past T's largest counts.
    long double wide = 0;
    auto [q, wec] = std::from_chars(text.data(), end, wide);
    if (wec == std::errc() && q == end && std::fabs(wide) <= std::numeric_limits<T>::max()) return 0;
  }
  return negative ? -1 : 1;
}

// The line for a number past T's range: the flag's own bound when its range has one on that
// side (it is tighter than the type's), else T's: "--vocab must be at most 2147483647".
template <typename T>
[[noreturn]] void past_type_range(const Flag& f, const Lines& lines, int side) {
  if (side > 0) {
    if (f.range == Range::kMinMax || f.range == Range::kPositiveAtMost)
      lines.out_of_range(fmt::format("must be at most {}", f.max));
    lines.out_of_range(fmt::format("must be at most {}", std::numeric_limits<T>::max()));
  }
  if (f.range == Range::kPositive || f.range == Range::kPositiveAtMost) lines.out_of_range("must be positive");
  if (f.range == Range::kNonNegative || std::is_unsigned_v<T>) lines.out_of_range("must not be negative");
  if (f.range == Range::kMinMax || f.range == Range::kAtLeast)
    lines.out_of_range(fmt::format("must be at least {}", f.min));
  lines.out_of_range(fmt::format("must be at least {}", std::numeric_limits<T>::lowest()));
}

template <typename T>
T number(const Flag& f, const Lines& lines, const std::string& v) {
  const auto out = to_number<T>(v);
  if (!out) {
    // A number T cannot hold says the range rather than "needs a number".
    if (const int side = past_range<T>(v)) past_type_range<T>(f, lines, side);
    lines.not_a_number(std::is_integral_v<T>);
  }
  if constexpr (std::is_floating_point_v<T>)
    if (!std::isfinite(*out)) lines.not_finite();
  check_range(f, lines, static_cast<double>(*out));
  return *out;
}

// "64M": a number (a fraction is fine when the bytes come out whole) and an optional suffix.
size_t bytes(const Flag& f, const Lines& lines, const std::string& v) {
  double mult = 1;
  std::string digits = v;
  if (!v.empty()) {
    switch (v.back()) {
      case 'K': case 'k': mult = 1 << 10; break;
      case 'M': case 'm': mult = 1 << 20; break;
      case 'G': case 'g': mult = 1 << 30; break;
      default: break;
    }
    if (mult > 1) digits.pop_back();
  }
  const auto x = to_number<double>(digits);
  // 2^64 itself is the first double past the range of size_t.
  if (!x || !(*x >= 0) || !(*x * mult < 18446744073709551616.0) || std::floor(*x * mult) != *x * mult)
    lines.not_a_size();
  const double n = *x * mult;
  check_range(f, lines, n);
  return static_cast<size_t>(n);
}

void set(const Table& t, const Flag& f, const std::string& v) {
  const Lines lines(t.style, f, v);
  if (*f.choices) {
    const auto choices = split_choices(f.choices);
    if (std::find(choices.begin(), choices.end(), v) == choices.end()) lines.not_a_choice(choices);
  }
  void* m = f.target.member();
  switch (f.target.kind()) {
    case Kind::kInt: *static_cast<int*>(m) = number<int>(f, lines, v); break;
    case Kind::kInt64: *static_cast<int64_t*>(m) = number<int64_t>(f, lines, v); break;
    case Kind::kUint64: *static_cast<uint64_t*>(m) = number<uint64_t>(f, lines, v); break;
    case Kind::kFloat: *static_cast<float*>(m) = number<float>(f, lines, v); break;
    case Kind::kDouble: *static_cast<double*>(m) = number<double>(f, lines, v); break;
    case Kind::kSeconds:
      *static_cast<Duration*>(m) =
          std::chrono::duration_cast<Duration>(std::chrono::duration<double>(number<double>(f, lines, v)));
      break;
    case Kind::kBytes: *static_cast<size_t*>(m) = bytes(f, lines, v); break;
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
    case Kind::kSeconds:
      return "S";
    case Kind::kBytes:
      return "BYTES";
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
    case Kind::kSeconds:
      return fmt::format("{}", std::chrono::duration<double>(*static_cast<const Duration*>(m)).count());
    case Kind::kBytes: return fmt::format("{}", *static_cast<const size_t*>(m));
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

// "-x" or "--name": what a positional table reads as a flag ("-" alone is an operand).
bool looks_like_flag(const std::string& arg) { return arg.size() > 1 && arg[0] == '-'; }

}  // namespace

Kind kind_of(const Flag& f) {
  const Kind k = f.target.kind();
  return *f.choices && k != Kind::kSwitch ? Kind::kChoice : k;
}

bool parse(const Table& table, const std::vector<std::string>& args, std::set<std::string>* given) {
  const bool colon = table.style == Style::kColon;
  std::map<std::string, const Flag*> by_name;
  for (const auto& f : table.flags) by_name[f.name] = &f;
  auto positional = [&](size_t from, size_t to) {
    if (table.rest) table.rest->insert(table.rest->end(), args.begin() + ptrdiff_t(from), args.begin() + ptrdiff_t(to));
  };
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    if (name == "-h" || name == "--help") {
      std::fputs(help(table).c_str(), stdout);
      return false;
    }
    if (table.positional != Positional::kNone) {
      if (name == "--") {
        positional(i + 1, args.size());
        break;
      }
      if (!looks_like_flag(name)) {
        if (table.positional == Positional::kRest) {
          positional(i, args.size());
          break;
        }
        positional(i, i + 1);
        continue;
      }
    }
    const auto eq = name.find('=');
    const bool inline_value = name.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (table.underscores) std::replace(name.begin(), name.end(), '_', '-');
    auto it = by_name.find(name);
    const bool is_switch = it != by_name.end() && kind_of(*it->second) == Kind::kSwitch;
    if (inline_value && is_switch && colon) throw usage_error("{} takes no value", name);
    // A switch takes no value, so "--switch=x" names no flag the program has.
    if (it == by_name.end() || (inline_value && is_switch)) {
      if (colon && !looks_like_flag(name))
        throw usage_error("unexpected argument {} (see {} --help)", name, table.program);
      if (colon) throw usage_error("unknown option {} (see {} --help)", name, table.program);
      throw usage_error("unknown option '{}'; run {} --help for the list", name, table.program);
    }
    const Flag& f = *it->second;
    if (!is_switch && !inline_value) {
      if (i + 1 >= args.size()) {
        if (colon) throw usage_error("{} needs a value (see {} --help)", name, table.program);
        throw usage_error("{} needs a value", name);
      }
      value = args[++i];
    }
    set(table, f, value);
    if (given) given->insert(name);
  }
  return true;
}

std::string help(const Table& table) {
  constexpr size_t kWidth = 100, kHelpColumn = 32;
  std::string out = fmt::format("usage: {} {}\n{}", table.program, *table.usage ? table.usage : "[options]",
                                table.summary);
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
  if (*table.epilogue) {
    out += '\n';
    out += table.epilogue;
    if (out.back() != '\n') out += '\n';
  }
  return out;
}

}  // namespace trn::flags
