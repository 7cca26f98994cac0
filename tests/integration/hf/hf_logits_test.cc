// trn-train --dump-logits on Hugging Face directories (tests/reference/hf_fixture.py: small random
// bf16 weights in Llama-3.2's config structure, rope_scaling of rope_type llama3, and Qwen2.5's
// with its q/k/v biases; each written as 2 shards): the logits of a fixed prompt, from one forward
// through the layout, equal the PyTorch reference forward (llama_reference.Llama with the llama3
// rope formula, fp32 on the widened bf16 weights) to 1e-4 of each row's largest logit, in one
// process and at --tp 2, --pp 2, --dp 2 --zero 1 and --dp 2 --zero 3; and bad --dump-logits input
// is one usage line with nothing written (--logits-tokens alone, one warning).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "tests/support/jobs.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace trn::test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string kFixture = TRN_HF_FIXTURE_SCRIPT;

// The prompt: ids from both tensor-parallel halves of either fixture's vocabulary (320, 352 rows).
const std::string kPrompt = "5 300 17 42 161 200 3 99 250 7 128 310";
constexpr size_t kPromptTokens = 12;

ProcResult run(std::vector<std::string> argv) {
  return run_all({ProcSpec{std::move(argv), {{"TRN_LOG_LEVEL", "warn"}}}}, 300s).at(0);
}

// Whether /usr/bin/python3 has PyTorch and NumPy (found, not imported: an import takes seconds).
bool have_torch() {
  return run({"/usr/bin/python3", "-c",
              "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('numpy')))"})
      .ok();
}

// trn-train on n ranks (trnrun when n > 1): load DIR, dump the prompt's logits to `out`, one step
// at lr 0.
ProcResult dump(int n, const std::string& dir, const std::string& out, const std::vector<std::string>& layout) {
  std::vector<std::string> args = {bin("trn-train"), "--init-hf", dir,      "--seq-len", "16", "--batch-size",
                                   "4",              "--steps",   "1",      "--lr",      "0",  "--dump-logits",
                                   out,              "--logits-tokens", kPrompt};
  args.insert(args.end(), layout.begin(), layout.end());
  return run(n > 1 ? trnrun_cmd(n, args) : args);
}

std::vector<float> floats(const std::string& path) {
  const std::string bytes = file_bytes(path);
  REQUIRE(bytes.size() % sizeof(float) == 0);
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// The largest difference of any logit from the reference's, over its row's largest |logit|.
double worst_difference(const std::vector<float>& got, const std::vector<float>& want, size_t vocab) {
  double worst = 0;
  for (size_t r = 0; r < want.size() / vocab; ++r) {
    double diff = 0, scale = 0;
    for (size_t j = r * vocab; j < (r + 1) * vocab; ++j) {
      diff = std::max(diff, std::fabs(double(got[j]) - double(want[j])));
      scale = std::max(scale, std::fabs(double(want[j])));
    }
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

}  // namespace

TEST_CASE(
    "dump-logits of Llama-3 (bf16, 2 shards, llama3 rope) and Qwen2.5 directories equal PyTorch's forward in one "
    "process and at tp 2, pp 2, dp 2 zero 1 and zero 3") {
  if (!have_torch()) {
    WARN("test skipped: PyTorch is not installed for /usr/bin/python3 (hf_fixture.py writes the directories and "
         "the reference)");
    return;
  }
  TempDir tmp;
  const std::vector<std::pair<int, std::vector<std::string>>> layouts = {
      {1, {}},
      {2, {"--tp", "2"}},
      {2, {"--pp", "2", "--micro-batches", "2"}},
      {2, {"--dp", "2", "--zero", "1"}},
      {2, {"--dp", "2", "--zero", "3"}}};
  for (const auto& [kind, vocab] : std::vector<std::pair<std::string, size_t>>{{"llama3", 320}, {"qwen2", 352}}) {
    const std::string dir = tmp.path() + "/" + kind, ref = tmp.path() + "/" + kind + "-reference.bin";
    // The directory, then the reference forward of the prompt on its weights.
    ProcResult r =
        run({"/usr/bin/python3", kFixture, "write", dir, "--kind", kind, "--shards", "2", "--tokens", kPrompt, "--out", ref});
    INFO(r.describe());
    REQUIRE(r.ok());
    REQUIRE(fs::exists(dir + "/model-00002-of-00002.safetensors"));
    const std::vector<float> want = floats(ref);
    REQUIRE(want.size() == kPromptTokens * vocab);
    for (size_t i = 0; i < layouts.size(); ++i) {
      const auto& [n, layout] = layouts[i];
      const std::string name = n == 1 ? "one process" : fmt::format("{}", fmt::join(layout, " "));
      const std::string out = fmt::format("{}/{}-{}.bin", tmp.path(), kind, i);
      r = dump(n, dir, out, layout);
      INFO(kind << " " << name << ": " << r.describe());
      REQUIRE(r.ok());
      const std::vector<float> got = floats(out);
      REQUIRE(got.size() == want.size());
      const double worst = worst_difference(got, want, vocab);
      std::printf("%s, %s: logits within %.2e of PyTorch's (of each row's largest)\n", kind.c_str(), name.c_str(),
                  worst);
      CHECK(worst <= 1e-4);
    }
  }
}

TEST_CASE("bad dump-logits input is one usage line, and nothing is written") {
  TempDir tmp;
  const std::string out = tmp.path() + "/logits.bin";
  auto train = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = {bin("trn-train"), "--model", "llama-tiny", "--seq-len", "8", "--batch-size", "2",
                                     "--steps", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run(args);
  };
  expect_usage_error(train({"--dump-logits", out}), {"--dump-logits", "--logits-tokens"});
  expect_usage_error(train({"--dump-logits", out, "--logits-tokens", "1 2 x"}),
                     {"--logits-tokens takes token ids", "'1 2 x'"});
  expect_usage_error(train({"--dump-logits", out, "--logits-tokens", "1 256"}), {"token id 256", "vocabulary of 256"});
  expect_usage_error(train({"--dump-logits", out, "--logits-tokens", "1 2 3 4 5 6 7 8 9"}),
                     {"9 tokens", "--seq-len 8"});
  expect_usage_error(train({"--dump-logits", out, "--logits-tokens", "1 2", "--cp", "2"}),
                     {"--dump-logits", "--cp 2"});
  CHECK(!fs::exists(out));
  // The prompt alone is a warning: the run goes on.
  const ProcResult alone = train({"--logits-tokens", "1 2"});
  INFO(alone.describe());
  CHECK(alone.ok());
  CHECK(alone.output.find("--logits-tokens has no effect without --dump-logits") != std::string::npos);
  const std::string missing = tmp.path() + "/no/such/dir/logits.bin";
  expect_usage_error(train({"--dump-logits", missing, "--logits-tokens", "1 2"}), {"--dump-logits", missing});
  CHECK(!fs::exists(tmp.path() + "/no"));
  CHECK(fs::is_empty(tmp.path()));
}
