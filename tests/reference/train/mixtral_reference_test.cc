// trn-train --arch mixtral against its PyTorch reference (tests/reference/mixtral_reference.py,
// system python3; HF MixtralForCausalLM names, the MoE written out as trn's contract says): same
// init and batches, 12 steps' cross-entropy and balancing loss within 1e-4 relative, final weights
// within 1e-4 max-abs, trn's saved file loads with load_state_dict(strict=True). Covered: top-2 of
// 4 experts renormalised (Mixtral) in one process, under --tp 2, --pp 2, --dp 2, and expert
// parallelism at --dp 2 --ep 2 (with --pp 2 too); top-3 of 8
// with the raw probabilities (OLMoE) and a capacity that drops tokens. The script's selftest (the
// MoE against a dense float64 computation, gradcheck, hand cases) runs first.
#include <catch2/catch.hpp>

#include "tests/support/process.h"

using namespace std::chrono_literals;

namespace {

void run_reference(const std::vector<std::string>& args, const char* want = "PASS") {
  trn::test::TempDir dir;
  std::vector<std::string> argv = {"/usr/bin/python3", TRN_MIXTRAL_REFERENCE_SCRIPT};
  argv.insert(argv.end(), args.begin(), args.end());
  if (args[0] == "compare") {
    for (const std::string& a : {std::string("--trn-train"), trn::test::bin("trn-train"), std::string("--trnrun"),
                                 trn::test::bin("trnrun"), std::string("--workdir"), dir.path()})
      argv.push_back(a);
  }
  const auto results = trn::test::run_all({{argv, {}}}, 300s);
  INFO(results[0].describe());
  CHECK(results[0].ok());
  CHECK(results[0].output.find(want) != std::string::npos);
  CHECK(results[0].output.find("FAIL") == std::string::npos);
}

}  // namespace

TEST_CASE("mixtral: the PyTorch reference passes its own checks", "[reference]") {
  run_reference({"selftest"}, "state-dict names are HF MixtralForCausalLM's");
}

TEST_CASE("mixtral: top-2 of 4 experts matches PyTorch for 12 steps, one process and --tp 2", "[reference]") {
  run_reference({"compare"});
  run_reference({"compare", "--tp", "2"});
}

TEST_CASE("mixtral: --pp 2 and --dp 2 match PyTorch", "[reference]") {
  run_reference({"compare", "--pp", "2"});
  run_reference({"compare", "--dp", "2"});
}

TEST_CASE("mixtral: expert parallelism (--dp 2 --ep 2, and with --pp 2) matches PyTorch", "[reference]") {
  run_reference({"compare", "--dp", "2", "--ep", "2"});
  run_reference({"compare", "--dp", "2", "--ep", "2", "--pp", "2"});
  run_reference({"compare", "--dp", "2", "--ep", "2", "--n-experts", "8", "--top-k", "3", "--moe-norm-topk", "0"});
}

TEST_CASE("mixtral: top-3 of 8 without renormalisation, with a capacity that drops, matches PyTorch",
          "[reference]") {
  run_reference({"compare", "--n-experts", "8", "--top-k", "3", "--moe-norm-topk", "0", "--capacity-factor", "1.0"});
}

TEST_CASE("mixtral: --moe-balance bias (no balancing loss) matches PyTorch, biases included", "[reference]") {
  run_reference({"compare", "--moe-balance", "bias", "--moe-aux-coef", "0"});
}
