// trn-train's model families from the command line: --arch and the presets, the Llama shape
// flags and their checks, and a saved model that --init rebuilds from its metadata alone.
#include <catch2/catch.hpp>

#include "runtime/io/safetensors.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace std::chrono_literals;
using trn::test::bin;
using trn::test::expect_usage_error;
using trn::test::TempDir;

namespace {

trn::test::ProcResult train(std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-train"));
  return trn::test::run_all({{args, {{"TRN_LOG_LEVEL", "warn"}}}}, 120s)[0];
}

std::vector<std::string> quick(std::vector<std::string> extra) {
  std::vector<std::string> a = {"--seq-len", "32", "--batch-size", "4", "--steps", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("a family or preset that does not exist or does not match is one line") {
  expect_usage_error(train(quick({"--arch", "mamba"})), {"unknown --arch 'mamba'", "gpt2 or llama"});
  expect_usage_error(train(quick({"--model", "llama-huge"})), {"unknown --model 'llama-huge'", "llama-small"});
  expect_usage_error(train(quick({"--arch", "llama", "--model", "small"})),
                     {"--model small is a gpt2 preset, not --arch llama"});
  expect_usage_error(train(quick({"--model", "tiny", "--tie-embeddings", "0"})), {"GPT-2's LM head is always"});
  expect_usage_error(train(quick({"--model", "tiny", "--n-kv-head", "2"})), {"--n-kv-head 2", "--arch llama"});
}

TEST_CASE("Llama's shape flags are checked: KV heads, head size, tensor parallelism") {
  expect_usage_error(train(quick({"--arch", "llama", "--n-kv-head", "3"})), {"--n-kv-head 3 must divide --n-head 4"});
  expect_usage_error(train(quick({"--arch", "llama", "--d-model", "12", "--n-head", "4", "--n-kv-head", "2"})),
                     {"head size of 3", "even"});
  expect_usage_error(train(quick({"--arch", "llama", "--tp", "4"})),
                     {"--tp 4 does not divide n_kv_head 2", "use --tp one of 1, 2"});
  expect_usage_error(train(quick({"--arch", "llama", "--tie-embeddings", "2"})), {"--tie-embeddings"});
}

TEST_CASE("a saved Llama records its shape, and --init rebuilds it with no model flags") {
  TempDir dir;
  const std::string file = dir.path() + "/m.safetensors";
  auto saved = train(quick({"--arch", "llama", "--n-kv-head", "1", "--tie-embeddings", "1", "--save", file}));
  INFO(saved.describe());
  REQUIRE(saved.ok());
  trn::io::SafetensorsFile f(file);
  CHECK(f.metadata().at("trn.model") ==
        "arch=llama n_layer=2 n_head=4 n_kv_head=1 d_model=128 ffn_dim=384 ctx=128 vocab=256 rope_theta=10000 "
        "norm_eps=1e-05 tie_embeddings=1");
  CHECK(f.tensors().count("lm_head.weight") == 0);  // tied
  CHECK(f.tensors().at("model.layers.0.self_attn.k_proj.weight").shape == std::vector<int64_t>{32, 128});
  auto loaded = train(quick({"--init", file, "--log-every", "1"}));
  INFO(loaded.describe());
  CHECK(loaded.ok());
  // A shape flag means the user's model: a mismatch with the file is one line naming the tensor.
  expect_usage_error(train(quick({"--init", file, "--n-layer", "3"})), {"model.layers.2", "is missing"});
  expect_usage_error(train(quick({"--init", file, "--arch", "gpt2"})), {"holds a llama model", "not --arch gpt2"});
}
