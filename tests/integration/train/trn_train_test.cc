// trn-train as a user runs it: a real process, its output and its files.
#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>

#include "tests/support/process.h"

using namespace std::chrono_literals;
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

// A usage error: exit 2 and one line "trn-train: error: ..." holding every phrase.
void expect_usage_error(const trn::test::ProcResult& r, std::vector<std::string> phrases) {
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK(r.output.rfind("trn-train: error: ", 0) == 0);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  for (const auto& p : phrases) CHECK(r.output.find(p) != std::string::npos);
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
  expect_usage_error(train(quick({"--model", "huge"})), {"--model", "tiny, small or gpt2"});
  expect_usage_error(train(quick({"--steps", "ten"})), {"--steps"});
  expect_usage_error(train(quick({"--frobnicate", "1"})), {"--frobnicate", "--help"});
  expect_usage_error(train(quick({"--dp", "2"})), {"--dp 2", "trnrun"});
  expect_usage_error(train(quick({"--n-head", "3"})), {"--d-model", "--n-head"});
}
