// Activation recomputation end to end (--recompute selective, full, --recompute-layers N): a
// recomputed block reruns its forward (full), or its norms and MLP activation (selective), from
// what it kept at the start of its backward, over the same weights, kernels and tensor-parallel
// sums, so a run's losses, gradient norms and saved weights are bit for bit those of --recompute
// none, in one process and at dp 2 x tp 2 x pp 2, for GPT-2 and Llama; and the stage holds fewer
// activation bytes. Bad values are one line and exit 2.
#include <catch2/catch.hpp>

#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> train_cmd(const std::string& dir, const std::string& name, const std::string& model,
                                   std::vector<std::string> extra) {
  std::vector<std::string> c = {bin("trn-train"), "--model", model, "--n-layer", "4", "--n-head", "4",
                                "--steps", "4", "--batch-size", "8", "--seq-len", "32", "--log-every", "1",
                                "--lr", "1e-3", "--metrics-jsonl", dir + "/" + name + ".jsonl",
                                "--save", dir + "/" + name + ".safetensors"};
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

// "..., N MB activations" of the first rank's start-up line.
double activation_mb(const std::string& output) {
  std::smatch m;
  REQUIRE(std::regex_search(output, m, std::regex("parameters on this rank, ([0-9.]+) MB activations")));
  return std::stod(m[1]);
}

void check_modes(int n, const std::string& model, const std::vector<std::string>& layout, bool memory) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::vector<std::string>>> modes = {
      {"none", {"--recompute", "none"}},
      {"selective", {"--recompute", "selective"}},
      {"full", {"--recompute", "full"}},
      {"first", {"--recompute", "full", "--recompute-layers", "2"}}};
  std::map<std::string, double> mb;
  for (const auto& [name, flags] : modes) {
    auto extra = layout;
    extra.insert(extra.end(), flags.begin(), flags.end());
    auto cmd = train_cmd(dir.path(), name, model, extra);
    const ProcResult r = run_all({ProcSpec{n > 1 ? trnrun_cmd(n, cmd) : cmd, {}}}, 400s).at(0);
    INFO(name << ": " << r.describe());
    REQUIRE(r.ok());
    mb[name] = activation_mb(r.output);
  }
  const auto want = jsonl_figures(dir.path() + "/none.jsonl");
  REQUIRE(want.size() == 4);
  for (const char* name : {"selective", "full", "first"}) {
    INFO(name);
    CHECK(jsonl_figures(dir.path() + "/" + name + ".jsonl") == want);
    CHECK(file_bytes(dir.path() + "/" + name + ".safetensors") == file_bytes(dir.path() + "/none.safetensors"));
  }
  if (!memory) return;
  // Full keeps a block's output where none keeps all its activations, plus one block's worth
  // they take turns in; the first two of four blocks lie between.
  CHECK(mb["full"] < mb["first"]);
  CHECK(mb["first"] < mb["none"]);
  CHECK(mb["selective"] < mb["none"]);
}

}  // namespace

TEST_CASE("recompute: --recompute selective and full equal none bit for bit in one process, GPT-2 and Llama, fp32 "
          "and bf16") {
  check_modes(1, "tiny", {}, true);
  check_modes(1, "llama-tiny", {"--precision", "bf16"}, true);
  // GPT-2's GELU output recomputed where the emulated path rounds it in place.
  check_modes(1, "tiny", {"--precision", "bf16", "--bf16-kernels", "emulated"}, false);
}

TEST_CASE("recompute: under ZeRO-3 at dp 2 with two compute threads and no prefetch, bf16, equal none bit for bit") {
  // Gathered blocks (the last one kept across the head's turn, the packed bf16 wire) read again by
  // the recomputation's forward.
  check_modes(2, "tiny", {"--dp", "2", "--zero", "3", "--threads", "2", "--zero-prefetch", "0", "--precision", "bf16"},
              false);
}

TEST_CASE("recompute: --recompute selective and full equal none bit for bit at dp 2 x tp 2 x pp 2, GPT-2 and Llama",
          "[slow]") {
  check_modes(8, "tiny", {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"}, false);
  check_modes(8, "llama-tiny",
              {"--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "4", "--schedule", "interleaved",
               "--virtual-stages", "2", "--precision", "bf16", "--zero", "3"},
              false);
}

TEST_CASE("recompute: bad values are one line and exit 2") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--recompute", "some"}, "choose none, selective or full"},
      {{"--recompute", "full", "--recompute-layers", "-1"}, "--recompute-layers"},
  };
  for (const auto& [flags, want] : cases) {
    std::vector<std::string> cmd = {bin("trn-train"), "--model", "tiny", "--steps", "1"};
    cmd.insert(cmd.end(), flags.begin(), flags.end());
    const ProcResult r = run_all({ProcSpec{cmd, {}}}, 60s).at(0);
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.output, Catch::Contains(want));
  }
  // Zero-bubble's weight pass reads what full recomputation drops.
  const ProcResult r = run_all({ProcSpec{trnrun_cmd(2, {bin("trn-train"), "--model", "tiny", "--steps", "1", "--pp", "2",
                                                        "--micro-batches", "2", "--schedule", "zb", "--recompute",
                                                        "full"}),
                                         {}}},
                               120s)
                           .at(0);
  INFO(r.describe());
  CHECK(!r.ok());
  CHECK_THAT(r.output, Catch::Contains("--recompute full with --schedule zb"));
}
