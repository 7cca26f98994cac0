// trn-train's bounds on long work, with the real programs: --eval-batches is clamped to the
// batches --val-data holds; SIGTERM during an evaluation stops the run at the next batch (alone,
// and under trnrun when only one rank is signalled); --snapshot-every without an in-place
// recovery to use the snapshots is one warning.
#include <catch2/catch.hpp>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// `bytes` of held-out text (raw bytes, a --data format).
std::string write_val_data(const std::string& dir, size_t bytes) {
  const std::string path = dir + "/val.txt";
  std::ofstream f(path, std::ios::binary);
  for (size_t i = 0, n = 0; n < bytes; ++i) {
    const std::string line = "Line " + std::to_string(i) + ": the quick brown fox jumps over " +
                             std::to_string((i * 7919) % 1000) + " lazy dogs.\n";
    f << line;
    n += line.size();
  }
  return path;
}

std::vector<std::string> train_cmd(std::vector<std::string> extra) {
  std::vector<std::string> c = {bin("trn-train"), "--model", "tiny", "--log-every", "1"};
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

ProcResult run(std::vector<std::string> argv) {
  return run_all({ProcSpec{std::move(argv), {{"TRN_LOG_LEVEL", "info"}}}}, 120s).at(0);
}

// The trn-train workers trnrun started (its children running trn-train).
std::vector<pid_t> workers_of(pid_t trnrun) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = file_bytes(e.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == trnrun && state != 'Z' && file_bytes(e.path().string() + "/cmdline").find("trn-train") != std::string::npos)
      out.push_back(pid_t(std::stol(name)));
  }
  return out;
}

// The stop's line. Step 2's evaluation is where the signal lands but for a very slow host, where
// it may still be step 2 itself: that stops the run after step 2 too (at its evaluation's first batch).
constexpr const char* kStopped = "trn-train: stopped by Terminated after step 2 of 2; nothing saved";

// Waits (up to a generous bound, so nothing hangs) until `path` has a line: step 1 is done.
void wait_for_first_step(Process& p, const std::string& path) {
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (file_bytes(path).empty() && p.running() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);
  REQUIRE_FALSE(file_bytes(path).empty());
}

// A run whose final evaluation lasts minutes: step 2's evaluation over a val set of hundreds of
// large batches (and, before the clamp, a billion of them).
std::vector<std::string> long_evaluation(const std::string& dir, const std::vector<std::string>& more = {}) {
  std::vector<std::string> c = train_cmd({"--steps", "2", "--batch-size", "64", "--seq-len", "128", "--val-data",
                                          write_val_data(dir, 2 << 20), "--eval-every", "2", "--eval-batches",
                                          "1000000000", "--metrics-jsonl", dir + "/m.jsonl", "--save",
                                          dir + "/w.safetensors"});
  c.insert(c.end(), more.begin(), more.end());
  return c;
}

}  // namespace

TEST_CASE("an --eval-batches past what --val-data holds is clamped to it, with one warning") {
  TempDir dir;
  // 64 KiB of text over batches of 4 x 32 tokens: 512 batches.
  const auto r = run(train_cmd({"--steps", "1", "--batch-size", "4", "--seq-len", "32", "--val-data",
                                write_val_data(dir.path(), 64 << 10), "--eval-batches", "1000000000"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(count_lines_with(r.output, "--eval-batches 1000000000 is more than the 512 global batches --val-data") == 1);
  CHECK_THAT(r.output, Catch::Contains("512 batches of 4 x 32 tokens"));
  CHECK_THAT(r.output, Catch::Contains("eval at step 1 | val loss"));
}

TEST_CASE("SIGTERM during a long evaluation stops trn-train at the next batch with one line") {
  TempDir dir;
  Process p(ProcSpec{long_evaluation(dir.path()), {{"TRN_LOG_LEVEL", "info"}}});
  wait_for_first_step(p, dir.path() + "/m.jsonl");
  std::this_thread::sleep_for(1s);  // most likely into step 2's evaluation; a stop in step 2 is honoured too
  p.signal(SIGTERM);
  // A hang guard, not a timing: the evaluation left to itself runs for minutes.
  const auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code == 128 + SIGTERM);
  CHECK(count_lines_with(r.output, kStopped) == 1);
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/w.safetensors"));
}

TEST_CASE("SIGTERM to one rank during a long evaluation stops every rank; none waits for another") {
  TempDir dir;
  Process p(ProcSpec{trnrun_cmd(2, long_evaluation(dir.path(), {"--dp", "2"})), {{"TRN_LOG_LEVEL", "info"}}});
  wait_for_first_step(p, dir.path() + "/m.jsonl");
  std::this_thread::sleep_for(1s);
  const std::vector<pid_t> workers = workers_of(p.pid());
  REQUIRE(workers.size() == 2);
  kill(workers[1], SIGTERM);  // one rank only: the other learns of it at the next batch
  const auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  REQUIRE_FALSE(r.timed_out);
  CHECK(r.exit_code != 0);
  // Both ranks took the stop path (one line each), neither died waiting for the other.
  CHECK(count_lines_with(r.output, kStopped) == 2);
  CHECK_FALSE(std::filesystem::exists(dir.path() + "/w.safetensors"));
}

TEST_CASE("snapshots without trnrun --recovery in-place to use them are one warning; with it, none") {
  const std::string warning = "--snapshot-every 1 without trnrun --recovery in-place";
  TempDir dir;
  const std::vector<std::string> prog =
      train_cmd({"--steps", "2", "--batch-size", "4", "--seq-len", "32", "--snapshot-every", "1"});
  const auto alone = run(prog);
  INFO(alone.describe());
  REQUIRE(alone.ok());
  CHECK(count_lines_with(alone.output, warning) == 1);
  auto two = prog;
  two.insert(two.end(), {"--dp", "2"});
  const auto plain = run(trnrun_cmd(2, two));
  INFO(plain.describe());
  REQUIRE(plain.ok());
  CHECK(count_lines_with(plain.output, warning) == 1);  // rank 0 only
  const auto in_place = run(trnrun_cmd(2, two, {"--recovery", "in-place"}));
  INFO(in_place.describe());
  REQUIRE(in_place.ok());
  CHECK(count_lines_with(in_place.output, warning) == 0);
}

TEST_CASE("SIGTERM while trn-train is still starting up ends it at once, by that signal") {
  // GPT-2 124M: building and initialising its parameters and AdamW's state takes seconds, where
  // no step boundary would read a stop flag. The snapshot warning is printed after the handlers
  // are installed and before the model is built: the signal is sent when it appears.
  const std::string started = "--snapshot-every 1 without trnrun --recovery in-place";
  Process p(ProcSpec{train_cmd({"--model", "gpt2", "--steps", "1", "--batch-size", "1", "--seq-len", "16",
                                "--snapshot-every", "1"}),
                     {{"TRN_LOG_LEVEL", "info"}}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (p.output_so_far().find(started) == std::string::npos && p.running() &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  REQUIRE(p.output_so_far().find(started) != std::string::npos);
  p.signal(SIGTERM);
  const auto r = p.wait(std::chrono::steady_clock::now() + 60s);  // a hang guard
  INFO(r.describe());
  REQUIRE_FALSE(r.timed_out);
  // Ended by the signal itself, not at a step boundary after the model was built.
  CHECK(r.signal == SIGTERM);
  CHECK(r.output.find("stopped by") == std::string::npos);
}
