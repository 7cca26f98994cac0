// trn-train against the PyTorch reference (tests/reference/gpt2_reference.py, system python3):
// same init and batches (one process, or --tp 2 and --tp 2 --pp 2 under trnrun), 20 steps' losses within 1e-4 relative, final weights within 1e-4
// max-abs, trn's saved file loads with load_state_dict(strict=True). --precision bf16 against
// torch.autocast bf16 with PyTorch fp32 as the yardstick (the tolerance: compare_bf16 there).
#include <catch2/catch.hpp>

#include "tests/support/process.h"

using namespace std::chrono_literals;

namespace {

void compare(const std::string& model, int threads, const std::string& seq_len, int tp = 1, int pp = 1,
             const std::string& precision = "fp32") {
  trn::test::TempDir dir;
  const auto results = trn::test::run_all(
      {{{"/usr/bin/python3", TRN_REFERENCE_SCRIPT, "compare", "--trn-train",
         trn::test::bin("trn-train"), "--workdir", dir.path(), "--model", model, "--steps", "20",
         "--batch-size", "4", "--seq-len", seq_len, "--threads", std::to_string(threads), "--tp",
         std::to_string(tp), "--pp", std::to_string(pp), "--trnrun", trn::test::bin("trnrun"), "--precision",
         precision},
        {}}},
      300s);
  INFO(results[0].describe());
  CHECK(results[0].ok());
  CHECK(results[0].output.find("PASS") != std::string::npos);
}

}  // namespace

TEST_CASE("trn-train matches PyTorch on tiny for 20 steps", "[reference]") { compare("tiny", 1, "64"); }

TEST_CASE("trn-train with tensor parallelism of 2 matches PyTorch on small", "[reference]") {
  compare("small", 1, "128", 2);
}

TEST_CASE("trn-train with --tp 2 --pp 2 matches PyTorch on small", "[reference]") {
  compare("small", 1, "128", 2, 2);
}

TEST_CASE("trn-train matches PyTorch on small with 2 threads", "[reference]") {
  compare("small", 2, "128");
}

TEST_CASE("trn-train --precision bf16 matches PyTorch autocast bf16 on tiny", "[reference]") {
  compare("tiny", 1, "64", 1, 1, "bf16");
}

TEST_CASE("trn-train --precision bf16 matches PyTorch autocast bf16 on small with 2 threads", "[reference]") {
  compare("small", 2, "128", 1, 1, "bf16");
}
