#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"

using namespace trn;
using flags::Range;

namespace {

struct Values {
  int count = 3;
  int64_t steps = 200;
  uint64_t seed = 7;
  float lr = 0.5f;
  double size = 25;
  std::string name = "a";
  std::string mode = "fast";
  int bit = 0;
  bool force = false;
  int clamp = 4;
  std::string parsed;
};

flags::Table table(Values* v) {
  return {"prog",
          "Does things.\n",
          {
              {"--count", &v->count, "how many", "Numbers", "N", nullptr, Range::kPositive},
              {"--steps", &v->steps, "steps to run", "Numbers", "N", nullptr, Range::kNonNegative},
              {"--seed", &v->seed, "random seed", "Numbers"},
              {"--lr", &v->lr, "learning rate", "Numbers", "X", nullptr, Range::kNonNegative},
              {"--size", &v->size, "bucket size", "Numbers", "X", nullptr, Range::kPositive, 0, 0, "", "",
               [v](auto& f, auto& text) {
                 if (v->size > 100) throw usage_error("{} {} is too large", f, text);
               }},
              {"--clamp", &v->clamp, "between 2 and 8", "Numbers", "N", nullptr, Range::kMinMax, 2, 8},
              {"--name", &v->name, "a name", "Text", "NAME"},
              {"--mode", &v->mode, "how to run", "Text", "", nullptr, Range::kAny, 0, 0, "fast|slow|off"},
              {"--bit", &v->bit, "on or off", "Text", "", nullptr, Range::kAny, 0, 0, "0|1", "1: on"},
              {"--force", &v->force, "do it anyway", "Text"},
              {"--parsed", [v](auto&, auto& text) { v->parsed = "<" + text + ">"; }, "custom parser", "Text",
               "WORD", "none"},
          }};
}

std::string error_of(std::vector<std::string> args) {
  Values v;
  try {
    flags::parse(table(&v), args);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  FAIL("expected a usage error for the arguments");
  return "";
}

}  // namespace

TEST_CASE("flags: each value kind parses into its member, inline or as the next argument") {
  Values v;
  std::set<std::string> given;
  REQUIRE(flags::parse(table(&v),
                       {"--count", "5", "--steps=0", "--seed", "18446744073709551615", "--lr", "1e-3", "--size=0.25",
                        "--clamp", "8", "--name", "x y", "--mode", "off", "--bit=1", "--force", "--parsed", "w"},
                       &given));
  CHECK(v.count == 5);
  CHECK(v.steps == 0);
  CHECK(v.seed == 18446744073709551615ull);
  CHECK(v.lr == 1e-3f);
  CHECK(v.size == 0.25);
  CHECK(v.clamp == 8);
  CHECK(v.name == "x y");
  CHECK(v.mode == "off");
  CHECK(v.bit == 1);
  CHECK(v.force);
  CHECK(v.parsed == "<w>");
  CHECK(given == std::set<std::string>{"--count", "--steps", "--seed", "--lr", "--size", "--clamp", "--name",
                                       "--mode", "--bit", "--force", "--parsed"});
}

TEST_CASE("flags: members keep their values when their flags are absent") {
  Values v;
  std::set<std::string> given;
  REQUIRE(flags::parse(table(&v), {}, &given));
  CHECK(given.empty());
  CHECK(v.count == 3);
  CHECK(v.name == "a");
  CHECK_FALSE(v.force);
}

TEST_CASE("flags: kinds follow the member's type") {
  Values v;
  const auto t = table(&v);
  auto kind = [&](const char* name) {
    for (const auto& f : t.flags)
      if (std::string(f.name) == name) return flags::kind_of(f);
    FAIL("no flag " << name);
    return flags::Kind::kString;
  };
  CHECK(kind("--count") == flags::Kind::kInt);
  CHECK(kind("--steps") == flags::Kind::kInt64);
  CHECK(kind("--seed") == flags::Kind::kUint64);
  CHECK(kind("--lr") == flags::Kind::kFloat);
  CHECK(kind("--size") == flags::Kind::kDouble);
  CHECK(kind("--name") == flags::Kind::kString);
  CHECK(kind("--mode") == flags::Kind::kChoice);
  CHECK(kind("--bit") == flags::Kind::kChoice);
  CHECK(kind("--force") == flags::Kind::kSwitch);
  CHECK(kind("--parsed") == flags::Kind::kString);
}

TEST_CASE("flags: every mistake is one usage line naming the flag and the value") {
  CHECK(error_of({"--count", "ten"}) == "--count needs a number, got 'ten'");
  CHECK(error_of({"--count", "1.5"}) == "--count needs a number, got '1.5'");
  CHECK(error_of({"--count=", "1"}) == "--count needs a number, got ''");
  CHECK(error_of({"--count", "0"}) == "--count must be positive, got 0");
  // A number the member's type cannot hold is out of range, not "not a number": the line says
  // the range (the test below covers each side and kind).
  CHECK(error_of({"--count", "99999999999"}) == "--count must be at most 2147483647, got 99999999999");
  CHECK(error_of({"--steps", "-1"}) == "--steps must not be negative, got -1");
  CHECK(error_of({"--seed", "-1"}) == "--seed must not be negative, got -1");
  CHECK(error_of({"--lr", "nan"}) == "--lr needs a finite number, got 'nan'");
  CHECK(error_of({"--lr", "-inf"}) == "--lr needs a finite number, got '-inf'");
  CHECK(error_of({"--lr", "-0.5"}) == "--lr must not be negative, got -0.5");
  CHECK(error_of({"--size", "0"}) == "--size must be positive, got 0");
  CHECK(error_of({"--size", "101"}) == "--size 101 is too large");
  CHECK(error_of({"--clamp", "1"}) == "--clamp must be at least 2, got 1");
  CHECK(error_of({"--clamp", "9"}) == "--clamp must be at most 8, got 9");
  CHECK(error_of({"--mode", "medium"}) == "--mode takes fast, slow or off, got 'medium'");
  CHECK(error_of({"--bit", "2"}) == "--bit takes 0 or 1 (1: on), got '2'");
  CHECK(error_of({"--bit=on"}) == "--bit takes 0 or 1 (1: on), got 'on'");
  CHECK(error_of({"--count"}) == "--count needs a value");
  CHECK(error_of({"--name", "x", "--steps"}) == "--steps needs a value");
  CHECK(error_of({"--frobnicate", "1"}) == "unknown option '--frobnicate'; run prog --help for the list");
  CHECK(error_of({"stray"}) == "unknown option 'stray'; run prog --help for the list");
  CHECK(error_of({"--force=1"}) == "unknown option '--force'; run prog --help for the list");
}

TEST_CASE("flags: -h and --help stop the parse") {
  for (const char* h : {"-h", "--help"}) {
    Values v;
    CHECK_FALSE(flags::parse(table(&v), {"--count", "5", h, "--count", "bad"}));
    CHECK(v.count == 5);
  }
}

TEST_CASE("flags: help lists every flag under its group, with its value, default and help line") {
  Values v;
  const std::string help = flags::help(table(&v));
  CHECK(help.rfind("usage: prog [options]\nDoes things.\n\nNumbers:\n", 0) == 0);
  CHECK(help.find("\nText:\n") != std::string::npos);
  CHECK(help.find("\nNumbers:\n") < help.find("\nText:\n"));
  // Defaults come from the members; choices stand in for the value name; a switch has neither.
  CHECK_THAT(help, Catch::Contains("  --count N (3)                 how many\n"));
  CHECK_THAT(help, Catch::Contains("  --steps N (200) "));
  CHECK_THAT(help, Catch::Contains("  --seed N (7) "));
  CHECK_THAT(help, Catch::Contains("  --lr X (0.5) "));
  CHECK_THAT(help, Catch::Contains("  --name NAME (a) "));
  CHECK_THAT(help, Catch::Contains("  --mode fast|slow|off (fast) "));
  CHECK_THAT(help, Catch::Contains("  --force                       do it anyway\n"));
  CHECK_THAT(help, Catch::Contains("  --parsed WORD (none) "));
  Values empty;
  empty.name.clear();
  CHECK_THAT(flags::help(table(&empty)), Catch::Contains("  --name NAME                   a name\n"));
  for (const auto& f : table(&v).flags) CHECK_THAT(help, Catch::Contains(std::string("  ") + f.name + " "));
}

TEST_CASE("flags: help wraps long lines and puts long entries on their own line") {
  Values v;
  auto t = table(&v);
  std::string long_help;
  for (int i = 0; i < 40; ++i) long_help += "word ";
  long_help += "end";
  flags::Flag long_flag{"--a-rather-long-flag-name", &v.name, long_help.c_str(), "Text", "SOMETHING"};
  t.flags.push_back(long_flag);
  const std::string help = flags::help(t);
  size_t start = 0;
  while (start < help.size()) {
    const size_t end = help.find('\n', start);
    CHECK(end - start <= 100);
    start = end + 1;
  }
  CHECK_THAT(help, Catch::Contains("  --a-rather-long-flag-name SOMETHING (a)\n" + std::string(32, ' ') + "word word"));
  CHECK_THAT(help, Catch::Contains("\n" + std::string(32, ' ') + "word"));
  CHECK_THAT(help, Catch::Contains("word end\n"));
}

namespace {

struct Tool {
  int workers = 4;
  int rank = -1;
  double late = 3;
  Duration wait = std::chrono::seconds(10);
  Duration retention = std::chrono::hours(1);
  size_t bytes = 8;
  bool tee = false;
  std::string mode = "a";
  std::vector<std::string> rest;
};

flags::Table tool_table(Tool* t, flags::Positional positional = flags::Positional::kNone) {
  return {
      .program = "tool",
      .summary = "Does tool things.\n",
      .flags =
          {
              {.name = "--workers", .target = &t->workers, .help = "workers", .range = Range::kAtLeast, .min = 1},
              {.name = "--rank", .target = &t->rank, .help = "rank", .default_text = "",
               .range = Range::kMinMax, .min = 0, .max = 7},
              {.name = "--late", .target = &t->late, .help = "late", .range = Range::kPositive},
              {.name = "--wait", .target = &t->wait, .help = "wait", .range = Range::kPositiveAtMost, .max = 60},
              {.name = "--retention", .target = &t->retention, .help = "retention", .range = Range::kNonNegative,
               .invalid = "expected seconds, from 0 on"},
              {.name = "-b", .target = flags::Bytes{&t->bytes}, .help = "bytes", .range = Range::kAtLeast, .min = 1},
              {"--tee", &t->tee, "tee"},
              {"--mode", &t->mode, "mode", "", "", nullptr, Range::kAny, 0, 0, "a|b"},
          },
      .style = flags::Style::kColon,
      .positional = positional,
      .rest = &t->rest,
      .usage = "[options] COMMAND",
      .epilogue = "Exit codes: 0 ok.\n",
      .underscores = true,
  };
}

std::string tool_error(std::vector<std::string> args, flags::Positional positional = flags::Positional::kNone) {
  Tool t;
  try {
    flags::parse(tool_table(&t, positional), args);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  FAIL("expected a usage error for the arguments");
  return "";
}

}  // namespace

TEST_CASE("flags: to_number takes the whole text as the number or nothing") {
  CHECK(flags::to_number<int>("42") == 42);
  CHECK(flags::to_number<int>("-3") == -3);
  CHECK_FALSE(flags::to_number<int>(""));
  CHECK_FALSE(flags::to_number<int>(" 1"));
  CHECK_FALSE(flags::to_number<int>("+1"));
  CHECK_FALSE(flags::to_number<int>("1x"));
  CHECK_FALSE(flags::to_number<int>("4294967296"));
  CHECK_FALSE(flags::to_number<uint64_t>("-1"));
  CHECK(flags::to_number<double>("2.5e-1") == 0.25);
  CHECK_FALSE(flags::to_number<double>("1.5s"));
}

TEST_CASE("flags: seconds and byte sizes parse into durations and byte counts") {
  Tool t;
  REQUIRE(flags::parse(tool_table(&t), {"--wait", "0.25", "--retention=0", "-b", "64M"}));
  CHECK(t.wait == std::chrono::milliseconds(250));
  CHECK(t.retention == Duration::zero());
  CHECK(t.bytes == size_t{64} << 20);
  for (auto [text, bytes] : std::vector<std::pair<std::string, size_t>>{
           {"8", 8}, {"4K", 4096}, {"4k", 4096}, {"1.5K", 1536}, {"2m", 2u << 20}, {"1G", size_t{1} << 30}}) {
    Tool b;
    REQUIRE(flags::parse(tool_table(&b), {"-b", text}));
    CHECK(b.bytes == bytes);
  }
  const std::string size_line = ": not a size (use a number with an optional K, M or G suffix, e.g. 64M)";
  for (const char* bad : {"1Q", "K", "", "-1", "0.5", "1.5", "1e30", "nan"})
    CHECK(tool_error({"-b", bad}) == std::string("-b ") + bad + size_line);
  CHECK(tool_error({"-b", "0"}) == "-b 0: must be at least 1");
}

TEST_CASE("flags: the colon wording names the flag and the value before what was expected") {
  CHECK(tool_error({"--workers", "two"}) == "--workers two: expected an integer");
  CHECK(tool_error({"--workers", "0"}) == "--workers 0: must be at least 1");
  CHECK(tool_error({"--rank", "8"}) == "--rank 8: must be at most 7");
  CHECK(tool_error({"--rank", "-1"}) == "--rank -1: must be at least 0");
  CHECK(tool_error({"--late", "x"}) == "--late x: expected a number");
  CHECK(tool_error({"--late", "inf"}) == "--late inf: expected a finite number");
  CHECK(tool_error({"--late", "0"}) == "--late 0: must be positive");
  CHECK(tool_error({"--wait", "0"}) == "--wait 0: must be positive");
  CHECK(tool_error({"--wait", "61"}) == "--wait 61: must be at most 60");
  CHECK(tool_error({"--retention", "-1"}) == "--retention -1: expected seconds, from 0 on");
  CHECK(tool_error({"--retention", "x"}) == "--retention x: expected seconds, from 0 on");
  CHECK(tool_error({"--mode", "c"}) == "--mode takes a or b, got 'c'");
  CHECK(tool_error({"--workers"}) == "--workers needs a value (see tool --help)");
  CHECK(tool_error({"--tee=1"}) == "--tee takes no value");
  CHECK(tool_error({"--frobnicate"}) == "unknown option --frobnicate (see tool --help)");
  CHECK(tool_error({"stray"}) == "unexpected argument stray (see tool --help)");
}

TEST_CASE("flags: a number past its type's range says the range, with the flag's own bound when it has one") {
  // The type's bound (int, int64, uint64, float), in both wordings.
  CHECK(error_of({"--count", "1000000000000"}) == "--count must be at most 2147483647, got 1000000000000");
  CHECK(error_of({"--count", "-99999999999"}) == "--count must be positive, got -99999999999");
  CHECK(error_of({"--steps", "99999999999999999999"}) ==
        "--steps must be at most 9223372036854775807, got 99999999999999999999");
  CHECK(error_of({"--seed", "18446744073709551616"}) ==
        "--seed must be at most 18446744073709551615, got 18446744073709551616");
  CHECK(error_of({"--seed", "-99999999999999999999"}) == "--seed must not be negative, got -99999999999999999999");
  CHECK(error_of({"--lr", "1e39"}) == "--lr must be at most 3.4028235e+38, got 1e39");
  CHECK(error_of({"--size", "1e999"}) == "--size must be at most 1.7976931348623157e+308, got 1e999");
  CHECK(tool_error({"--workers", "4294967296"}) == "--workers 4294967296: must be at most 2147483647");
  CHECK(tool_error({"--workers", "-4294967296"}) == "--workers -4294967296: must be at least 1");
  // A flag with a bound of its own on that side names it (tighter than the type's).
  CHECK(error_of({"--clamp", "99999999999"}) == "--clamp must be at most 8, got 99999999999");
  CHECK(error_of({"--clamp", "-99999999999"}) == "--clamp must be at least 2, got -99999999999");
  CHECK(tool_error({"--rank", "4294967296"}) == "--rank 4294967296: must be at most 7");
  // A row's own line still stands for every rejected value; what is no number stays one.
  CHECK(tool_error({"--retention", "1e999"}) == "--retention 1e999: expected seconds, from 0 on");
  CHECK(error_of({"--count", "1e12"}) == "--count needs a number, got '1e12'");
  CHECK(error_of({"--count", "-"}) == "--count needs a number, got '-'");
  CHECK(error_of({"--lr", "1e-999"}) == "--lr needs a number, got '1e-999'");
}

TEST_CASE("flags: underscores read as dashes when the table says so") {
  Tool t;
  flags::Table table = tool_table(&t);
  table.flags.push_back({.name = "--max-restarts", .target = &t.rank, .help = "restarts"});
  REQUIRE(flags::parse(table, {"--max_restarts=3"}));
  CHECK(t.rank == 3);
  CHECK(error_of({"--warm_up", "1"}) == "unknown option '--warm_up'; run prog --help for the list");
}

TEST_CASE("flags: interleaved positional arguments are collected in order, flags anywhere") {
  Tool t;
  std::set<std::string> given;
  REQUIRE(flags::parse(tool_table(&t, flags::Positional::kInterleaved),
                       {"status", "--tee", "job", "--workers", "2", "-", "--", "--rank", "x"}, &given));
  CHECK(t.rest == std::vector<std::string>{"status", "job", "-", "--rank", "x"});
  CHECK(t.tee);
  CHECK(t.workers == 2);
  CHECK(t.rank == -1);
  CHECK(given == std::set<std::string>{"--tee", "--workers"});
  CHECK(tool_error({"status", "--bogus"}, flags::Positional::kInterleaved) ==
        "unknown option --bogus (see tool --help)");
}

TEST_CASE("flags: in rest mode the first argument that is not a flag and all after it are positional") {
  Tool t;
  REQUIRE(flags::parse(tool_table(&t, flags::Positional::kRest), {"--workers", "2", "sh", "-c", "--workers 3"}));
  CHECK(t.workers == 2);
  CHECK(t.rest == std::vector<std::string>{"sh", "-c", "--workers 3"});
  Tool d;
  REQUIRE(flags::parse(tool_table(&d, flags::Positional::kRest), {"--tee", "--", "--workers", "-h"}));
  CHECK(d.tee);
  CHECK(d.workers == 4);
  CHECK(d.rest == std::vector<std::string>{"--workers", "-h"});
  Tool h;
  CHECK_FALSE(flags::parse(tool_table(&h, flags::Positional::kRest), {"-h", "prog"}));
  CHECK(h.rest.empty());
}

TEST_CASE("flags: help shows the table's usage line, seconds and sizes, and the epilogue") {
  Tool t;
  const std::string help = flags::help(tool_table(&t));
  CHECK(help.rfind("usage: tool [options] COMMAND\nDoes tool things.\n", 0) == 0);
  CHECK_THAT(help, Catch::Contains("  --wait S (10) "));
  CHECK_THAT(help, Catch::Contains("  --retention S (3600) "));
  CHECK_THAT(help, Catch::Contains("  -b BYTES (8) "));
  CHECK_THAT(help, Catch::Contains("  --rank N                      rank\n"));
  CHECK(help.size() > 18);
  CHECK(help.substr(help.size() - 19) == "\nExit codes: 0 ok.\n");
  for (const auto& f : tool_table(&t).flags) CHECK_THAT(help, Catch::Contains(std::string("  ") + f.name + " "));
}
