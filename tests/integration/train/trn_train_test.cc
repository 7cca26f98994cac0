// trn-train as a user runs it: a real process, its output and its files.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <thread>

#include <signal.h>

#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace std::chrono_literals;
using trn::test::expect_usage_error;
using trn::test::bin;
using trn::test::TempDir;

namespace {

trn::test::ProcResult train(std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-train"));
  return trn::test::run_all({{args, {{"TRN_LOG_LEVEL", "info"}}}}, 120s)[0];
}

// Short runs: tiny model, short sequences.
std::vector<std::string> quick(std::vector<std::string> extra) {
  std::vector<std::string> a = {"--model", "tiny", "--seq-len", "32", "--batch-size", "4",
                                "--log-every", "5"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<double> field(const std::string& jsonl, const std::string& key) {
  std::vector<double> out;
  std::istringstream in(jsonl);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("\"" + key + "\": ");
    REQUIRE(at != std::string::npos);
    out.push_back(std::stod(line.substr(at + key.size() + 4)));
  }
  return out;
}

}  // namespace

TEST_CASE("trn-train trains the default corpus: loss falls, metrics and weights are written") {
  TempDir dir;
  const std::string metrics = dir.path() + "/m.jsonl", save = dir.path() + "/w.safetensors";
  const auto r = train(quick({"--steps", "40", "--lr", "3e-3", "--warmup-steps", "5",
                              "--metrics-jsonl", metrics, "--save", save, "--threads", "2"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(r.output.find("step 40/40 | loss ") != std::string::npos);
  CHECK(r.output.find("tok/s | ETA ") != std::string::npos);
  const std::string m = read(metrics);
  const auto loss = field(m, "loss");
  REQUIRE(loss.size() == 40);
  CHECK(loss.front() > 5.0);
  CHECK(loss.back() < 0.75 * loss.front());
  for (const char* k : {"step", "lr", "grad_norm", "tokens_per_s", "elapsed_s"})
    CHECK(field(m, k).size() == 40);
  CHECK(read(save).size() > 445952 * 4);
}

TEST_CASE("same seed, same output: losses, grad norms and saved weights are bit-identical") {
  TempDir dir;
  for (const char* threads : {"1", "2"}) {
    std::string out[2], w[2];
    for (int run = 0; run < 2; ++run) {
      const std::string m = dir.path() + "/m" + std::to_string(run);
      const std::string s = dir.path() + "/w" + std::to_string(run);
      const auto r = train(quick({"--steps", "8", "--seed", "11", "--threads", threads,
                                  "--metrics-jsonl", m, "--save", s}));
      INFO(r.describe());
      REQUIRE(r.ok());
      out[run] = read(m);
      w[run] = read(s);
    }
    INFO("threads " << threads);
    CHECK(field(out[0], "loss") == field(out[1], "loss"));
    CHECK(field(out[0], "grad_norm") == field(out[1], "grad_norm"));
    CHECK(w[0] == w[1]);
  }
}

TEST_CASE("micro-batches accumulate to the same step as one batch") {
  TempDir dir;
  std::vector<double> loss[2];
  for (int mb : {1, 2}) {
    const std::string m = dir.path() + "/m" + std::to_string(mb);
    const auto r = train(quick({"--steps", "4", "--micro-batches", std::to_string(mb),
                                "--metrics-jsonl", m}));
    INFO(r.describe());
    REQUIRE(r.ok());
    loss[mb - 1] = field(read(m), "loss");
  }
  for (size_t i = 0; i < loss[0].size(); ++i) CHECK(loss[1][i] == Approx(loss[0][i]).epsilon(1e-5));
}

TEST_CASE("bad input: one clear line and a non-zero exit") {
  TempDir dir;
  expect_usage_error(train(quick({"--data", dir.path() + "/missing.txt"})),
                     {"missing.txt", "--data"});
  std::ofstream(dir.path() + "/short.txt") << "only a few bytes";
  expect_usage_error(train(quick({"--data", dir.path() + "/short.txt"})),
                     {"short.txt", "fewer than one sequence"});
  // weights of another model shape
  const std::string small = dir.path() + "/small.safetensors";
  REQUIRE(train({"--model", "small", "--seq-len", "8", "--batch-size", "1", "--steps", "1",
                 "--save", small})
              .ok());
  expect_usage_error(train(quick({"--init", small})), {"small.safetensors", "wte.weight", "shape"});
  // a corrupted header
  std::string bytes = read(small);
  bytes[20] = '#';
  std::ofstream(dir.path() + "/corrupt.safetensors", std::ios::binary) << bytes;
  expect_usage_error(train(quick({"--init", dir.path() + "/corrupt.safetensors"})),
                     {"corrupt safetensors header"});
  expect_usage_error(train(quick({"--model", "huge"})), {"--model", "use tiny, small, gpt2, llama-tiny, llama-small"});
  expect_usage_error(train(quick({"--steps", "ten"})), {"--steps"});
  expect_usage_error(train(quick({"--frobnicate", "1"})), {"--frobnicate", "--help"});
  expect_usage_error(train(quick({"--dp", "2"})), {"--dp 2", "trnrun"});
  expect_usage_error(train(quick({"--n-head", "3"})), {"--d-model", "--n-head"});
}

TEST_CASE("output paths are checked before step 1") {
  TempDir dir;
  for (const char* flag : {"--save", "--metrics-jsonl", "--dump-batches"}) {
    INFO(flag);
    auto missing = train(quick({flag, dir.path() + "/no/such/dir/out"}));
    expect_usage_error(missing, {flag, "does not exist"});
    auto is_dir = train(quick({flag, dir.path()}));
    expect_usage_error(is_dir, {flag, "is a directory"});
    std::ofstream(dir.path() + "/plain") << "x";
    auto under_file = train(quick({flag, dir.path() + "/plain/out"}));
    expect_usage_error(under_file, {flag, "is not a directory"});
  }
}

TEST_CASE("non-finite and inconsistent numbers are usage errors") {
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--lr", "nan"}, {"--lr", "inf"}, {"--weight-decay", "nan"}, {"--beta1", "-nan"},
           {"--grad-clip", "inf"}, {"--min-lr", "nan"}, {"--bucket-mb", "inf"}}) {
    INFO(flag << " " << value);
    expect_usage_error(train(quick({flag, value})), {flag, "finite"});
  }
  expect_usage_error(train(quick({"--lr", "1e-3", "--min-lr", "1e-2"})), {"--min-lr", "above --lr"});
  expect_usage_error(train(quick({"--d-model", "1e9"})), {"--d-model", "needs a number"});
  expect_usage_error(train(quick({"--d-model", "1000000000"})), {"--d-model", "largest supported"});
  expect_usage_error(train(quick({"--d-model", "16384", "--n-layer", "64"})), {"GB", "this host has"});
}

TEST_CASE("bad files are usage errors, not bugs: directories, broken llm.c headers, NaN weights") {
  TempDir dir;
  expect_usage_error(train(quick({"--data", dir.path()})), {"--data", "is a directory"});
  expect_usage_error(train(quick({"--init", dir.path()})), {"--init", "is a directory"});
  std::string bad_magic(1024 + 64, '\0');
  bad_magic[0] = 0x11;  // not 20240520
  std::ofstream(dir.path() + "/bad.bin", std::ios::binary) << bad_magic;
  expect_usage_error(train(quick({"--data", dir.path() + "/bad.bin"})), {"bad.bin", "magic"});
  std::ofstream(dir.path() + "/short.bin", std::ios::binary) << std::string(100, 'a');
  expect_usage_error(train(quick({"--data", dir.path() + "/short.bin"})), {"short.bin", "header"});
  // A weights file with one NaN: the last tensor's last float.
  const std::string good = dir.path() + "/good.safetensors";
  REQUIRE(train(quick({"--steps", "1", "--save", good})).ok());
  std::string bytes = read(good);
  const char nan_bits[4] = {0x00, 0x00, char(0xc0), 0x7f};
  bytes.replace(bytes.size() - 4, 4, nan_bits, 4);
  std::ofstream(dir.path() + "/nan.safetensors", std::ios::binary) << bytes;
  expect_usage_error(train(quick({"--init", dir.path() + "/nan.safetensors"})), {"non-finite"});
}

TEST_CASE("a run that diverges stops at the step with one line and saves nothing") {
  TempDir dir;
  auto r = train(quick({"--lr", "1e30", "--min-lr", "0", "--steps", "20", "--save", dir.path() + "/w.safetensors"}));
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("training diverged"));
  CHECK_THAT(r.output, Catch::Matches("(.|\n)*trn-train: error: step [0-9]+: the (loss|gradient norm) is (.|\n)*"));
  CHECK_FALSE(std::ifstream(dir.path() + "/w.safetensors").good());
}

TEST_CASE("a metrics file that cannot be written stops the run") {
  auto r = train(quick({"--steps", "5", "--metrics-jsonl", "/dev/full"}));
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("cannot write --metrics-jsonl /dev/full at step 1"));
}

TEST_CASE("SIGINT and SIGTERM stop trn-train with one line and exit 128 + signal") {
  for (int sig : {SIGINT, SIGTERM}) {
    TempDir dir;
    trn::test::Process p({{bin("trn-train"), "--model", "tiny", "--steps", "1000000", "--save",
                           dir.path() + "/w.safetensors", "--metrics-jsonl", dir.path() + "/m.jsonl"},
                          {}});
    // Wait until training runs (a metrics line is out), then signal.
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (read(dir.path() + "/m.jsonl").empty() && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(20ms);
    p.signal(sig);
    auto r = p.wait(std::chrono::steady_clock::now() + 60s);
    INFO(r.describe());
    CHECK(r.exit_code == 128 + sig);
    CHECK_THAT(r.output, Catch::Contains("trn-train: stopped by"));
    CHECK_THAT(r.output, Catch::Contains("nothing saved"));
    CHECK_FALSE(std::ifstream(dir.path() + "/w.safetensors").good());
  }
}

TEST_CASE("more threads than processors is a warning") {
  auto r = train(quick({"--steps", "1", "--threads", "64", "--batch-size", "64"}));
  INFO(r.describe());
  CHECK(r.ok());
  CHECK_THAT(r.output, Catch::Contains("--threads 64 is more than the"));
}
