// A program's command-line flags as one table: each row names a flag, the member it sets (whose
// type is the flag's value kind), what values it takes, the default shown in --help, a help line
// and the group it is listed under. parse() and help() both read the table, so the list a user
// sees and the flags a program accepts cannot drift apart. Shaped like the settings registry
// (settings.h), which does the same for TRN_* environment variables.
//
// Every mistake is one usage error naming the flag and the value, in one of two wordings (the
// table's Style; each program keeps the one its users and scripts know):
//   kGot (trn-train, trn-ckpt, trn-sgemm-probe):
//     "--steps needs a number, got 'ten'", "--lr needs a finite number, got 'nan'",
//     "--dp must be positive, got 0", "--warmup-steps must not be negative, got -1",
//     "--x must be at least 2, got 1", "--x must be at most 8, got 9", "--steps needs a value",
//     "--vocab must be at most 2147483647, got 1000000000000" (a number past the member's type:
//     its range, or the flag's own bound on that side, never "needs a number"),
//     "unknown option '--frobnicate'; run PROGRAM --help for the list".
//   kColon (trnrun, trnctl, trn-coordinator and the benchmarks):
//     "--nproc-per-node two: expected an integer", "--nproc-per-node 0: must be at least 1",
//     "--late x: expected a number", "-b 1Q: not a size (...)", "--tee takes no value",
//     "--nnodes needs a value (see trnrun --help)", "unknown option --bogus (see trnrun --help)".
//   Both: "--precision takes fp32 or bf16, got 'fp16'". A row's `invalid` text replaces the
//   number, range and choice lines of that flag with "NAME VALUE: INVALID".
//
// A flag takes its value as the next argument or inline (--flag=value); a switch takes none.
// Arguments that are not flags are an error, or positional (Table::positional): interleaved with
// the flags (a subcommand and its operands), or everything from the first one on (a command to
// run). "--" ends the flags in both positional modes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "collectives/core/deadline.h"

namespace trn::flags {

enum class Kind { kInt, kInt64, kUint64, kFloat, kDouble, kSeconds, kBytes, kString, kChoice, kSwitch };

enum class Range {
  kAny,
  kPositive,        // more than 0
  kNonNegative,     // 0 or more
  kMinMax,          // min <= x <= max
  kAtLeast,         // min <= x
  kPositiveAtMost,  // 0 < x <= max
};

enum class Style { kGot, kColon };  // the wording of the error lines (see the top of this file)

enum class Positional {
  kNone,         // every argument is a flag (or a flag's value)
  kInterleaved,  // arguments that are not flags, anywhere, are positional: "status JOB --json"
  kRest,         // the first argument that is not a flag, and all after it: "[options] PROGRAM ARGS"
};

// A byte count with an optional K, M or G suffix (either case, powers of 1024): "8", "4K", "64M".
struct Bytes {
  size_t* p;
};

// The number parser every flag uses: all of text as a T (std::from_chars: no sign for unsigned,
// no leading '+' or space, no trailing characters), or nullopt.
template <typename T>
std::optional<T> to_number(const std::string& text);

// A flag whose value a domain parser reads (an enum, a name it normalizes): called with the flag's
// name and value, it sets the member itself and throws a usage error for a value it rejects.
using Parser = std::function<void(const std::string& flag, const std::string& value)>;

// The member a flag sets. Its type is the value kind: bool* is a switch (no value, sets true),
// Duration* takes seconds, Bytes a size, std::string* with choices is a choice, int* with choices
// takes one of those numbers; a Parser is a string flag that sets its member itself.
class Target {
 public:
  // Implicit, so that a table row names the member directly: {"--steps", &o->steps, ...}.
  Target(int* p) : kind_(Kind::kInt), p_(p) {}
  Target(int64_t* p) : kind_(Kind::kInt64), p_(p) {}
  Target(uint64_t* p) : kind_(Kind::kUint64), p_(p) {}
  Target(float* p) : kind_(Kind::kFloat), p_(p) {}
  Target(double* p) : kind_(Kind::kDouble), p_(p) {}
  Target(std::string* p) : kind_(Kind::kString), p_(p) {}
  Target(bool* p) : kind_(Kind::kSwitch), p_(p) {}
  Target(Duration* p) : kind_(Kind::kSeconds), p_(p) {}  // the value is in seconds: "0.5"
  Target(Bytes b) : kind_(Kind::kBytes), p_(b.p) {}
  template <typename F, typename = std::enable_if_t<std::is_invocable_v<F&, const std::string&, const std::string&>>>
  Target(F parser) : kind_(Kind::kString), parser_(std::move(parser)) {}

  Kind kind() const { return kind_; }  // kInt ... kString or kSwitch; choices make a kChoice of it
  void* member() const { return p_; }  // null for a Parser
  const Parser& parser() const { return parser_; }

 private:
  Kind kind_;
  void* p_ = nullptr;
  Parser parser_;
};

struct Flag {
  const char* name;  // "--steps"
  Target target;
  const char* help;
  const char* group = "";
  const char* value_name = "";  // in --help after the name: "N", "FILE"; "" picks one by kind
  // The default --help shows: nullptr renders the member's value when help() runs (nothing for
  // an empty string, a switch or a Parser); "" shows none.
  const char* default_text = nullptr;
  Range range = Range::kAny;
  double min = 0, max = 0;   // kMinMax; kAtLeast: min; kPositiveAtMost: max
  const char* choices = "";  // "a|b|c": the value must be one of them
  // Appended to the choice error after the list: "--zero takes 0 or 1 (1: ZeRO-1), got '2'".
  const char* choices_note = "";
  // Runs after the member is set, for checks that need the parsed value (may throw).
  Parser then = nullptr;
  // The one line for any value this flag's kind, range or choices reject: "NAME VALUE: INVALID"
  // ("--heartbeat-timeout 0: expected seconds, more than 0 and at most 86400"); "" words each.
  const char* invalid = "";
};

Kind kind_of(const Flag& f);

struct Table {
  const char* program;  // "trn-train": named in the unknown-option line and the usage line
  const char* summary;  // lines printed after the usage line
  std::vector<Flag> flags;
  Style style = Style::kGot;
  Positional positional = Positional::kNone;
  std::vector<std::string>* rest = nullptr;  // receives the positional arguments, in order
  // After "usage: PROGRAM ": "[options]" when empty; may be several lines ("...\n       PROGRAM ...").
  const char* usage = "";
  const char* epilogue = "";  // printed after the flags
  bool underscores = false;   // '_' in a flag's name reads as '-' (torchrun's --max_restarts)
};

// Parses args (without argv[0]) into the table's members, in order. Returns false after printing
// help() to stdout for -h or --help; otherwise fills *given (when not null) with every flag seen
// and *table.rest with the positional arguments.
bool parse(const Table& table, const std::vector<std::string>& args, std::set<std::string>* given = nullptr);

// The --help text: a usage line, the summary, then each group with one entry per flag
// ("--name VALUE (default)" and its help, wrapped), then the epilogue.
std::string help(const Table& table);

}  // namespace trn::flags
