// Mixture of experts end to end (--arch mixtral): every layout matches one process, the balancing
// bias moves the same on every rank, a checkpoint resumes exactly, and what it cannot run is one
// line and exit 2. Routing is a pure function of a sequence's tokens and the weights, so layouts
// choose the same experts and differ only in rounding (measured 2e-9 .. 2e-8 fp32, 6e-6 bf16).
#include <catch2/catch.hpp>

#include <cmath>
#include <regex>

#include "tests/support/jobs.h"
#include "tests/support/loss_compare.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

struct Run {
  std::vector<double> losses, aux, dropped, grad_norms;
  std::string output;
  std::string first_loads;  // step 1's "moe_loads" (--metrics-moe-loads), as written
};

// The text of the first "moe_loads": [[...], ...] in jsonl.
std::string first_loads(const std::string& jsonl) {
  std::smatch m;
  return std::regex_search(jsonl, m, std::regex("\"moe_loads\": (\\[[^a-z]*?\\]\\])")) ? m[1].str() : "";
}

std::vector<double> field(const std::string& jsonl, const std::string& key) {
  std::vector<double> out;
  const std::regex re("\"" + key + "\": ([0-9.e+-]+)");
  for (auto it = std::sregex_iterator(jsonl.begin(), jsonl.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back(std::stod((*it)[1]));
  return out;
}

Run train(const TempDir& dir, const std::string& name, int n, const std::vector<std::string>& extra, int steps = 4) {
  std::vector<std::string> cmd = {bin("trn-train"), "--model", "mixtral-tiny", "--n-layer", "4", "--steps",
                                  std::to_string(steps), "--batch-size", "4", "--seq-len", "32", "--log-every", "1",
                                  "--lr", "1e-3", "--metrics-jsonl", dir.path() + "/" + name + ".jsonl",
                                  "--metrics-moe-loads"};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  const ProcResult r = run_all({ProcSpec{n > 1 ? trnrun_cmd(n, cmd) : cmd, {}}}, 400s).at(0);
  INFO(name << ": " << r.describe());
  REQUIRE(r.ok());
  const std::string jsonl = file_bytes(dir.path() + "/" + name + ".jsonl");
  return {jsonl_losses(dir.path() + "/" + name + ".jsonl"), field(jsonl, "aux_loss"), field(jsonl, "moe_dropped"),
          field(jsonl, "grad_norm"), r.output, first_loads(jsonl)};
}

void check_layouts(const std::vector<std::string>& model_flags,
                   const std::vector<std::pair<int, std::vector<std::string>>>& layouts, double rel,
                   int steps = 4) {
  TempDir dir;
  const Run one = train(dir, "one", 1, model_flags, steps);
  REQUIRE(one.aux.size() == one.losses.size());
  // Every layer's expert loads over the global batch (trn-plan --moe-loads reads them).
  REQUIRE_THAT(one.first_loads, Catch::Matchers::StartsWith("[["));
  int i = 0;
  for (const auto& [n, layout] : layouts) {
    auto flags = layout;
    flags.insert(flags.end(), model_flags.begin(), model_flags.end());
    const Run r = train(dir, "layout" + std::to_string(i++), n, flags, steps);
    std::string shown;
    for (const auto& f : flags) shown += f + " ";
    INFO(shown);
    check_all_close(r.losses, one.losses, rel);
    check_all_close(r.aux, one.aux, rel);
    CHECK(r.dropped == one.dropped);
    // The first step routes the same tokens to the same experts whatever the layout.
    CHECK(r.first_loads == one.first_loads);
    // The first step's gradient, before any update could move a choice.
    REQUIRE(!r.grad_norms.empty());
    check_all_close({r.grad_norms[0]}, {one.grad_norms[0]}, rel);
  }
}

}  // namespace

TEST_CASE("moe: dp with ZeRO 1 and 3, tp with sequence parallelism, pp schedules and recomputation match one process") {
  check_layouts({},
                {{2, {"--dp", "2", "--zero", "3"}},
                 {2, {"--tp", "2", "--sequence-parallel", "--recompute", "selective"}},
                 {2, {"--pp", "2", "--virtual-stages", "2", "--schedule", "interleaved", "--micro-batches", "4"}},
                 {4, {"--dp", "2", "--pp", "2", "--micro-batches", "2", "--zero", "1", "--recompute", "full"}}},
                1e-5);
  // A capacity that drops, the balancing bias, and top-3 of 8 without renormalisation.
  check_layouts({"--n-experts", "8", "--top-k", "3", "--moe-norm-topk", "0", "--capacity-factor", "1",
                 "--moe-balance", "bias"},
                {{2, {"--dp", "2", "--zero", "3"}}, {2, {"--tp", "2", "--threads", "2"}}}, 1e-5);
}

// One step: routing is a discontinuous function of the weights, so after an update a layout's
// bf16 rounding (2e-5 on the emulated path under tp) may move a token to another expert and the
// losses part by more than any rounding tolerance (measured: 2.6e-4 at step 2 with AVX2 kernels).
// The first step routes identically in every layout, and its loss, balancing loss and gradient
// norm check the whole forward and backward.
TEST_CASE("moe: bf16 layouts match one process to bf16's layout tolerance") {
  check_layouts({"--precision", "bf16"}, {{2, {"--tp", "2"}}, {2, {"--dp", "2", "--zero", "2"}}}, 1e-4, 1);
}

// The biases steer the routing, so a resume that lost them would route, and lose, otherwise.
TEST_CASE("moe: a checkpoint resumes with the same losses and balancing losses, at another layout too") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  const std::vector<std::string> bias = {"--moe-balance", "bias", "--capacity-factor", "1.5"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.end(), bias.begin(), bias.end());
    return flags;
  };
  const Run whole = train(dir, "whole", 2, with({"--dp", "2", "--checkpoint-dir", ck, "--checkpoint-every", "4"}), 8);
  REQUIRE(whole.losses.size() == 8);
  const std::string at4 = ck + "/step-00000004";
  int i = 0;
  for (const auto& [n, layout] : std::vector<std::pair<int, std::vector<std::string>>>{
           {2, {"--dp", "2"}}, {1, {}}, {2, {"--tp", "2"}}}) {
    std::vector<std::string> flags = with({"--resume", at4});
    flags.insert(flags.end(), layout.begin(), layout.end());
    const Run r = train(dir, "resumed" + std::to_string(i++), n, flags, 8);
    CHECK_THAT(r.output, Catch::Contains("resumed from " + at4 + " at step 4"));
    check_all_close(r.losses, std::vector<double>(whole.losses.begin() + 4, whole.losses.end()), 1e-5);
    check_all_close(r.aux, std::vector<double>(whole.aux.begin() + 4, whole.aux.end()), 1e-5);
  }
}

// Expert parallelism: each expert's rows are multiplied on its expert rank, in one product over
// the tokens of the whole expert group, so results differ from one process by rounding only.
TEST_CASE("moe: expert parallelism with dp, ZeRO, tp, pp and threads matches one process") {
  check_layouts({},
                {{2, {"--dp", "2", "--ep", "2"}},
                 {4, {"--dp", "4", "--ep", "4"}},
                 {4, {"--dp", "4", "--ep", "2", "--threads", "2"}},
                 {4, {"--dp", "4", "--ep", "2", "--zero", "1"}},
                 {4, {"--dp", "4", "--ep", "2", "--zero", "3"}},
                 {4, {"--dp", "2", "--ep", "2", "--tp", "2", "--sequence-parallel"}},
                 {4, {"--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2", "--recompute", "full"}}},
                1e-5);
  check_layouts({"--n-experts", "8", "--top-k", "3", "--moe-norm-topk", "0", "--capacity-factor", "1",
                 "--moe-balance", "bias"},
                {{2, {"--dp", "2", "--ep", "2"}},
                 {4, {"--dp", "4", "--ep", "4", "--zero", "2"}}},
                1e-5);
}

TEST_CASE("moe: a bf16 step under expert parallelism matches one process to bf16's layout tolerance") {
  check_layouts({"--precision", "bf16"}, {{2, {"--dp", "2", "--ep", "2"}}}, 1e-4, 1);
}

// Every expert is saved by name, by the expert rank holding it, so a checkpoint reshards to any
// expert-parallel size.
TEST_CASE("moe: a checkpoint saved at ep 4 resumes at ep 1 and 2 (with ZeRO too) with the same losses") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  const std::vector<std::string> bias = {"--moe-balance", "bias", "--n-experts", "8", "--top-k", "2"};
  auto with = [&](std::vector<std::string> flags) {
    flags.insert(flags.end(), bias.begin(), bias.end());
    return flags;
  };
  const Run whole =
      train(dir, "whole", 4, with({"--dp", "4", "--ep", "4", "--checkpoint-dir", ck, "--checkpoint-every", "3"}), 6);
  REQUIRE(whole.losses.size() == 6);
  const std::string at3 = ck + "/step-00000003";
  int i = 0;
  for (const auto& [n, layout] : std::vector<std::pair<int, std::vector<std::string>>>{
           {1, {}}, {2, {"--dp", "2", "--ep", "2"}}, {4, {"--dp", "4", "--ep", "2", "--zero", "2"}}}) {
    std::vector<std::string> flags = with({"--resume", at3});
    flags.insert(flags.end(), layout.begin(), layout.end());
    const Run r = train(dir, "resumed" + std::to_string(i++), n, flags, 6);
    CHECK_THAT(r.output, Catch::Contains("resumed from " + at3 + " at step 3"));
    check_all_close(r.losses, std::vector<double>(whole.losses.begin() + 3, whole.losses.end()), 1e-5);
    check_all_close(r.aux, std::vector<double>(whole.aux.begin() + 3, whole.aux.end()), 1e-5);
  }
}

TEST_CASE("moe: what it cannot run is one line and exit 2") {
  const std::vector<std::tuple<int, std::vector<std::string>, std::string>> cases = {
      {1, {"--top-k", "5"}, "--top-k 5 must be between 1 and --n-experts 4"},
      {1, {"--n-experts", "0"}, "--n-experts"},
      {2, {"--cp", "2"}, "--cp 2 with a mixture of experts"},
      {2, {"--pp", "2", "--schedule", "zb", "--micro-batches", "2"}, "--schedule zb with a mixture of experts"},
      {1, {"--moe-balance", "loss"}, "--moe-balance"},
      {1, {"--arch", "llama", "--model", "llama-tiny", "--n-experts", "4"}, "are mixtral's"},
      {1, {"--model", "tiny", "--top-k", "2"}, "a gpt2 block's MLP is dense"},  // once ignored
      {2, {"--dp", "2", "--ep", "3"}, "--ep 3 must divide the 4 experts"},
      {2, {"--dp", "2", "--ep", "4"}, "--ep 4 splits the experts over data-parallel ranks: it must divide --dp 2"},
      {2, {"--model", "llama-tiny", "--arch", "llama", "--dp", "2", "--ep", "2"}, "--ep 2 splits the experts of a mixture"},
      {1, {"--model", "llama-tiny", "--arch", "llama", "--metrics-jsonl", "/dev/null", "--metrics-moe-loads"},
       "--metrics-moe-loads: the model has no experts"},
      {1, {"--metrics-moe-loads"}, "give --metrics-jsonl FILE"},
  };
  for (const auto& [n, flags, want] : cases) {
    std::vector<std::string> cmd = {bin("trn-train"), "--model", "mixtral-tiny", "--steps", "1", "--batch-size", "4",
                                    "--seq-len", "32"};
    cmd.insert(cmd.end(), flags.begin(), flags.end());
    const ProcResult r = run_all({ProcSpec{n > 1 ? trnrun_cmd(n, cmd) : cmd, {}}}, 120s).at(0);
    INFO(r.describe());
    CHECK(!r.ok());
    CHECK_THAT(r.output, Catch::Contains(want));
  }
}
