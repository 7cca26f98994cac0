// Validation (--val-data, --eval-every, --eval-batches) end to end with the real programs: the
// validation loss of a layout equals the one-process run's to 1e-5 (data, tensor and pipeline
// parallelism and all three at once, for both families), evaluating changes nothing in training
// (losses and saved weights bit-identical), it is reported in the log and --metrics-jsonl, and
// bad flags get one line.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "tests/support/jobs.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

// Held-out text as raw bytes (a --data format), different from the built-in training corpus.
std::string write_val_data(const std::string& dir) {
  const std::string path = dir + "/val.txt";
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 400; ++i)
    f << "Line " << i << ": the quick brown fox jumps over " << (i * 7919) % 1000 << " lazy dogs.\n";
  return path;
}

const std::vector<std::string> kGpt2 = {"--model", "tiny", "--n-head", "8"};
const std::vector<std::string> kLlama = {"--arch", "llama", "--model", "llama-tiny", "--n-head", "16", "--n-kv-head", "8"};

std::vector<std::string> train_cmd(const std::vector<std::string>& model, const std::string& jsonl,
                                   std::vector<std::string> extra) {
  std::vector<std::string> c = {bin("trn-train")};
  c.insert(c.end(), model.begin(), model.end());
  c.insert(c.end(), {"--steps", "2", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-4", "--log-every", "1",
                     "--metrics-jsonl", jsonl});
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

ProcResult run(std::vector<std::string> argv, const std::string& level = "info") {
  return run_all({ProcSpec{std::move(argv), {{"TRN_LOG_LEVEL", level}}}}, 400s).at(0);
}

// (step, val_loss) of every --metrics-jsonl line that has one.
std::map<int, double> val_losses(const std::string& jsonl) {
  std::ifstream f(jsonl);
  std::map<int, double> out;
  const std::regex re("\"step\": ([0-9]+).*\"val_loss\": ([-0-9.eE+]+), \"val_ppl\": ([-0-9.eE+]+)");
  for (std::string line; std::getline(f, line);) {
    std::smatch m;
    if (std::regex_search(line, m, re)) {
      out[std::stoi(m[1])] = std::stod(m[2]);
      CHECK(std::abs(std::stod(m[3]) - std::exp(std::stod(m[2]))) <= 1e-6 * std::stod(m[3]));
    }
  }
  return out;
}

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  int world() const { return dp * tp * pp; }
};

}  // namespace

TEST_CASE("validation loss is equal across layouts") {
  TempDir dir;
  const std::string val = write_val_data(dir.path());
  const std::vector<Layout> layouts = {{1, 1, 1}, {2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 2}};
  for (const auto& [family, model] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"gpt2", kGpt2}, {"llama", kLlama}}) {
    std::map<int, double> one;
    double worst = 0.0;
    for (const Layout& l : layouts) {
      const std::string jsonl = dir.path() + "/" + family + std::to_string(l.dp) + std::to_string(l.tp) +
                                std::to_string(l.pp) + ".jsonl";
      std::vector<std::string> extra = {"--val-data", val, "--eval-every", "1", "--eval-batches", "3",
                                        "--dp", std::to_string(l.dp), "--tp", std::to_string(l.tp)};
      if (l.pp > 1) extra.insert(extra.end(), {"--pp", "2", "--micro-batches", "2"});
      const auto prog = train_cmd(model, jsonl, extra);
      auto r = run(l.world() == 1 ? prog : trnrun_cmd(l.world(), prog));
      INFO(family << " dp " << l.dp << " tp " << l.tp << " pp " << l.pp << ": " << r.describe());
      REQUIRE(r.ok());
      CHECK(count_lines_with(r.output, "eval at step 1 | val loss ") == 1);
      CHECK(count_lines_with(r.output, "eval at step 2 | val loss ") == 1);
      const std::map<int, double> got = val_losses(jsonl);
      REQUIRE(got.size() == 2);
      if (one.empty()) {
        one = got;
        // Near log(vocab) for an untrained model: a real loss, not a constant.
        CHECK(one.at(1) > 1.0);
        continue;
      }
      for (const auto& [step, loss] : one) {
        INFO("step " << step << ": " << loss << " vs " << got.at(step));
        CHECK(std::abs(loss - got.at(step)) <= 1e-5 * loss);
        worst = std::max(worst, std::abs(loss - got.at(step)) / loss);
      }
    }
    WARN(family << ": validation loss " << one.at(1) << " at step 1, largest relative difference across layouts "
                << worst);
  }
}

TEST_CASE("evaluating changes nothing in training: losses and weights are bit-identical") {
  TempDir dir;
  const std::string val = write_val_data(dir.path());
  for (const Layout& l : std::vector<Layout>{{1, 1, 1}, {2, 1, 2}}) {
    std::vector<std::string> files, jsonls;
    for (const bool eval : {false, true}) {
      const std::string name = dir.path() + "/" + std::to_string(l.world()) + (eval ? "eval" : "plain");
      std::vector<std::string> extra = {"--steps", "4", "--save", name + ".safetensors", "--dp",
                                        std::to_string(l.dp)};
      if (l.pp > 1) extra.insert(extra.end(), {"--pp", "2", "--micro-batches", "2"});
      if (eval) extra.insert(extra.end(), {"--val-data", val, "--eval-every", "1", "--eval-batches", "2"});
      const auto prog = train_cmd(kGpt2, name + ".jsonl", extra);
      auto r = run(l.world() == 1 ? prog : trnrun_cmd(l.world(), prog));
      INFO("world " << l.world() << (eval ? " with" : " without") << " evaluation: " << r.describe());
      REQUIRE(r.ok());
      CHECK(count_lines_with(r.output, "eval at step ") == (eval ? 4u : 0u));
      files.push_back(file_bytes(name + ".safetensors"));
      jsonls.push_back(name + ".jsonl");
    }
    const std::vector<double> plain = jsonl_losses(jsonls[0]), with = jsonl_losses(jsonls[1]);
    REQUIRE(plain.size() == 4);
    CHECK(plain == with);  // exact
    CHECK(!files[0].empty());
    CHECK(files[0] == files[1]);
  }
}

TEST_CASE("the metrics line carries val_loss after the steps that validate, and the log says so") {
  TempDir dir;
  const std::string val = write_val_data(dir.path()), jsonl = dir.path() + "/m.jsonl";
  auto r = run(train_cmd(kGpt2, jsonl, {"--steps", "5", "--val-data", val, "--eval-every", "2"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  const std::map<int, double> got = val_losses(jsonl);
  CHECK(got.size() == 3);
  CHECK(got.count(2) == 1);
  CHECK(got.count(4) == 1);
  CHECK(got.count(5) == 1);  // always after the last step
  CHECK(jsonl_losses(jsonl).size() == 5);  // every step keeps its line
  CHECK(count_lines_with(r.output, "eval at step ") == 3);
  CHECK(std::regex_search(r.output, std::regex("eval at step 4 \\| val loss [0-9.]+ \\| ppl [0-9.]+")));
  // Without --eval-every: only after the last step.
  auto last = run(train_cmd(kGpt2, jsonl, {"--steps", "3", "--val-data", val}));
  INFO(last.describe());
  REQUIRE(last.ok());
  const std::map<int, double> only = val_losses(jsonl);
  CHECK(only.size() == 1);
  CHECK(only.count(3) == 1);
}

TEST_CASE("validation flags the run cannot use: a warning, or one usage line") {
  TempDir dir;
  const std::string jsonl = dir.path() + "/m.jsonl";
  for (const std::string flag : {"--eval-every", "--eval-batches"}) {
    auto r = run(train_cmd(kGpt2, jsonl, {"--steps", "1", flag, "2"}), "warn");
    INFO(r.describe());
    CHECK(r.ok());
    CHECK(count_lines_with(r.output, " warning ") == 1);
    CHECK(count_lines_with(r.output, flag + " has no effect without --val-data") == 1);
  }
  const std::string val = write_val_data(dir.path());
  expect_usage_error(run(train_cmd(kGpt2, jsonl, {"--val-data", dir.path() + "/missing.bin"}), "warn"),
                     {"--val-data", "missing.bin"});
  expect_usage_error(run(train_cmd(kGpt2, jsonl, {"--val-data", val, "--eval-batches", "0"}), "warn"), {"--eval-batches"});
  expect_usage_error(run(train_cmd(kGpt2, jsonl, {"--val-data", val, "--eval-every", "-1"}), "warn"), {"--eval-every"});
}

TEST_CASE("the forward-only pass runs over interleaved and zero-bubble pipelines alike") {
  TempDir dir;
  const std::string val = write_val_data(dir.path());
  const std::vector<std::pair<int, std::vector<std::string>>> layouts = {
      {1, {}},
      {2, {"--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "2"}},
      {4, {"--pp", "4", "--schedule", "zb", "--micro-batches", "4"}}};
  std::map<int, double> one;
  for (const auto& [world, layout] : layouts) {
    const std::string jsonl = dir.path() + "/" + std::to_string(world) + ".jsonl";
    std::vector<std::string> extra = {"--n-layer", "4", "--val-data", val, "--eval-every", "1", "--eval-batches", "2"};
    extra.insert(extra.end(), layout.begin(), layout.end());
    const auto prog = train_cmd(kGpt2, jsonl, extra);
    auto r = run(world == 1 ? prog : trnrun_cmd(world, prog));
    INFO("world " << world << ": " << r.describe());
    REQUIRE(r.ok());
    const std::map<int, double> got = val_losses(jsonl);
    REQUIRE(got.size() == 2);
    if (one.empty()) one = got;
    for (const auto& [step, loss] : one) CHECK(std::abs(loss - got.at(step)) <= 1e-5 * loss);
  }
}
