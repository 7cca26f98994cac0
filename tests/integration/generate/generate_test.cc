// trn-generate: greedy output and KV-cached logits equal a PyTorch full recompute of the same
// weights (both families), a model trained on a repeated text continues it (bytes, and through a
// SentencePiece tokenizer), sampling is deterministic for a seed, a Mixtral's greedy logits equal
// trn-train's forward of the same tokens, and bad input is one line and exit 2.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "runtime/io/safetensors.h"
#include "runtime/model/config.h"
#include "runtime/model/family.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace std::chrono_literals;
using trn::test::bin;
using trn::test::expect_usage_error;
using trn::test::TempDir;

namespace {

trn::test::ProcResult run(const std::string& program, std::vector<std::string> args,
                          std::chrono::seconds timeout = 120s) {
  args.insert(args.begin(), bin(program));
  return trn::test::run_all({{args, {{"TRN_LOG_LEVEL", "warn"}}}}, timeout)[0];
}

trn::test::ProcResult generate(std::vector<std::string> args) { return run("trn-generate", std::move(args)); }

// A model trained for a few steps and saved, with its trn.model metadata.
std::string trained(const TempDir& dir, std::vector<std::string> flags, const std::string& name) {
  const std::string file = dir.path() + "/" + name + ".safetensors";
  flags.insert(flags.end(), {"--steps", "3", "--seq-len", "32", "--batch-size", "4", "--save", file});
  auto r = run("trn-train", flags);
  INFO(r.describe());
  REQUIRE(r.ok());
  return file;
}

// The continuation trn-generate printed: stdout after the prompt, without the final newline.
// The tokens/s line goes to stderr, which ProcResult interleaves; it is the last line.
std::string continuation(const trn::test::ProcResult& r, const std::string& prompt) {
  const auto stats = r.output.rfind("trn-generate: prefill");
  REQUIRE(stats != std::string::npos);
  REQUIRE(r.output.compare(0, prompt.size(), prompt) == 0);
  REQUIRE(stats > prompt.size());
  return std::string(r.output.begin() + long(prompt.size()), r.output.begin() + long(stats) - 1);
}

}  // namespace

TEST_CASE("greedy trn-generate equals a PyTorch greedy decode of the same weights, for both families") {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
    WARN("PyTorch is not installed for /usr/bin/python3: the reference comparison is skipped");
    return;
  }
  TempDir dir;
  auto r = trn::test::run_all({{{"/usr/bin/python3", TRN_GENERATE_REFERENCE_SCRIPT, "--trn-train", bin("trn-train"),
                                 "--trn-generate", bin("trn-generate"), "--workdir", dir.path()},
                                {{"TRN_LOG_LEVEL", "warn"}}}},
                              300s)[0];
  INFO(r.describe());
  CHECK(r.ok());
  for (const char* c : {"gpt2: ok", "llama-untied-kv2: ok", "llama-tied-kv1: ok", "llama-untied-kv1: ok",
                        "llama-tied-kv2: ok"})
    CHECK(r.output.find(c) != std::string::npos);
}

TEST_CASE("greedy is reproducible, a seed fixes a sample, and the stats line reports both phases") {
  TempDir dir;
  const std::string file = trained(dir, {"--model", "llama-tiny"}, "m");
  const std::vector<std::string> base = {"--model", file, "--prompt", "Hello", "--max-new-tokens", "24"};
  auto g1 = generate(base), g2 = generate(base);
  INFO(g1.describe());
  REQUIRE(g1.ok());
  CHECK(continuation(g1, "Hello") == continuation(g2, "Hello"));
  CHECK(continuation(g1, "Hello").size() == 24);
  CHECK(g1.output.find("prefill 5 tokens") != std::string::npos);
  CHECK(g1.output.find("decode 23 tokens") != std::string::npos);
  std::vector<std::string> s = base;
  s.insert(s.end(), {"--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "7"});
  auto s1 = generate(s), s2 = generate(s);
  INFO(s1.describe());
  REQUIRE(s1.ok());
  CHECK(continuation(s1, "Hello") == continuation(s2, "Hello"));
  std::vector<std::string> other = base;
  other.insert(other.end(), {"--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--seed", "8"});
  auto s3 = generate(other);
  CHECK(continuation(s1, "Hello") != continuation(s3, "Hello"));  // a near-uniform model: seeds differ
  // More tokens than the context holds stop at it.
  auto full = generate({"--model", file, "--prompt", "Hello", "--max-new-tokens", "1000"});
  INFO(full.describe());
  REQUIRE(full.ok());
  CHECK(continuation(full, "Hello").size() == 128 - 5);
  CHECK(full.output.find("stopped at the context length 128") != std::string::npos);
}

TEST_CASE("a llama-tiny trained on a repeated text continues it from its first words") {
  TempDir dir;
  // No prefix of a window is ambiguous, and --seq-len is the whole context, so every position
  // generation reaches was trained.
  const std::string text =
      "The quick brown fox jumps over the lazy dog, then runs into the forest to find its friends by the river. ";
  {
    std::ofstream f(dir.path() + "/text.txt", std::ios::binary);
    for (int i = 0; i < 300; ++i) f << text;
  }
  const std::string file = dir.path() + "/m.safetensors";
  auto t = run("trn-train", {"--model", "llama-tiny", "--data", dir.path() + "/text.txt", "--steps", "250",
                             "--seq-len", "128", "--batch-size", "4", "--lr", "5e-3", "--warmup-steps", "20",
                             "--save", file},
               300s);
  INFO(t.describe());
  REQUIRE(t.ok());
  const std::string prompt = "The quick brown fox";
  // The whole context: the rest of the text, and into its next repetition.
  auto g = generate({"--model", file, "--prompt", prompt, "--max-new-tokens", "109"});
  INFO(g.describe());
  REQUIRE(g.ok());
  const std::string twice = text + text;
  const std::string want(twice.begin() + long(prompt.size()), twice.begin() + long(prompt.size()) + 109);
  CHECK(continuation(g, prompt) == want);
}

TEST_CASE("bad input to trn-generate is one line and exit 2") {
  TempDir dir;
  const std::string p = "trn-generate";
  expect_usage_error(generate({"--model", dir.path() + "/absent.safetensors", "--prompt", "x"}),
                     {"absent.safetensors"}, p);
  // A file without trn.model metadata (written by PyTorch, say).
  const trn::model::ParamLayout lay(trn::model::preset("tiny"));
  std::vector<float> params(lay.total(), 0.0f);
  const std::string bare = dir.path() + "/bare.safetensors";
  trn::io::save_gpt2(bare, lay, params.data());
  expect_usage_error(generate({"--model", bare, "--prompt", "x"}), {"no trn.model metadata", "--preset"}, p);
  auto with_preset = generate({"--model", bare, "--preset", "tiny", "--prompt", "x", "--max-new-tokens", "3"});
  INFO(with_preset.describe());
  CHECK(with_preset.ok());
  const std::string file = trained(dir, {"--model", "tiny"}, "gpt2");
  expect_usage_error(generate({"--model", file, "--prompt", std::string(129, 'a')}),
                     {"--prompt is 129 tokens", "holds 128"}, p);
  expect_usage_error(generate({"--model", file, "--prompt", ""}), {"--prompt"}, p);
  expect_usage_error(generate({"--model", file, "--prompt", "x", "--top-p", "1.5"}), {"--top-p"}, p);
  // A count past its type's range says the range, not "needs a number".
  expect_usage_error(generate({"--model", file, "--prompt", "x", "--max-new-tokens", "1000000000000"}),
                     {"--max-new-tokens must be at most 2147483647, got 1000000000000"}, p);
  expect_usage_error(generate({"--model", file, "--prompt", "x", "--preset", "llama-tiny"}),
                     {"model.embed_tokens.weight"}, p);
}

TEST_CASE("through a SentencePiece tokenizer: trn-data's model, shards, trn-train, trn-generate") {
  TempDir dir;
  const std::string text =
      "The quick brown fox jumps over the lazy dog, then runs into the forest to find its friends by the river. ";
  std::filesystem::create_directories(dir.path() + "/corpus");
  {
    std::ofstream f(dir.path() + "/corpus/fox.txt", std::ios::binary);
    for (int i = 0; i < 300; ++i) f << text << "\n";
  }
  std::filesystem::copy_file("/usr/share/common-licenses/GPL-3", dir.path() + "/corpus/gpl.txt");
  const std::string tok = dir.path() + "/tok.model", shards = dir.path() + "/shards";
  for (auto args : std::vector<std::vector<std::string>>{
           {"tokenizer", "train", "--input", dir.path() + "/corpus/*.txt", "--vocab", "512", "--model-type", "bpe",
            "--out", tok},
           {"tokenize", "--tokenizer", tok, "--input", dir.path() + "/corpus/*.txt", "--out", shards}}) {
    auto r = run("trn-data", args);
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  const std::string file = dir.path() + "/m.safetensors";
  auto t = run("trn-train", {"--model", "llama-tiny", "--data", shards, "--steps", "150", "--seq-len", "128",
                             "--batch-size", "4", "--save", file},
               300s);
  INFO(t.describe());
  REQUIRE(t.ok());
  auto g = generate({"--model", file, "--tokenizer", tok, "--prompt", "The quick brown", "--max-new-tokens", "40"});
  INFO(g.describe());
  REQUIRE(g.ok());
  CHECK(g.output.rfind("The quick brown fox jumps over the lazy dog, then runs into the forest to find its friends by "
                       "the river.",
                       0) == 0);
  // The tokenizer and the model must agree; a byte-level model cannot take this tokenizer's pieces.
  const std::string bytes = trained(dir, {"--model", "llama-tiny"}, "bytes");
  expect_usage_error(generate({"--model", bytes, "--tokenizer", tok, "--prompt", "x"}), {"has 512 pieces"},
                     "trn-generate");
  expect_usage_error(generate({"--model", file, "--prompt", "x"}), {"vocabulary of 512", "--tokenizer"},
                     "trn-generate");
  expect_usage_error(generate({"--model", file, "--tokenizer", dir.path() + "/none.model", "--prompt", "x"}),
                     {"none.model"}, "trn-generate");
}

TEST_CASE("a model vocabulary padded past its tokenizer's never samples the padding, however many rows it adds") {
  TempDir dir;
  std::filesystem::create_directories(dir.path() + "/corpus");
  std::filesystem::copy_file("/usr/share/common-licenses/GPL-3", dir.path() + "/corpus/gpl.txt");
  const std::string tok = dir.path() + "/tok.model";
  auto t = run("trn-data", {"tokenizer", "train", "--input", dir.path() + "/corpus/*.txt", "--vocab", "300",
                            "--model-type", "bpe", "--out", tok});
  INFO(t.describe());
  REQUIRE(t.ok());
  // 300 pieces padded to 512 (a multiple of 512): ids 300..511 are 41% of a near-uniform
  // distribution after 3 steps, so 100 hot samples that never decode one are no accident.
  const std::string padded = trained(dir, {"--model", "tiny", "--vocab", "512"}, "padded");
  auto g = generate({"--model", padded, "--tokenizer", tok, "--prompt", "The", "--max-new-tokens", "100",
                     "--temperature", "5", "--seed", "3"});
  INFO(g.describe());
  CHECK(g.ok());
  CHECK_THAT(g.output, Catch::Contains("trn-generate: prefill"));
  // 1000 rows for 300 pieces is padding too (Qwen2.5 has 151936 rows for 151665 ids): any model
  // with a row for every id generates; one with fewer rows than ids is refused (above, "has 512
  // pieces").
  const std::string other = trained(dir, {"--model", "tiny", "--vocab", "1000"}, "other");
  g = generate({"--model", other, "--tokenizer", tok, "--prompt", "The", "--max-new-tokens", "100", "--temperature",
                "5", "--seed", "3"});
  INFO(g.describe());
  CHECK(g.ok());
}

// 300 positions: prefixes and a split prefill that end inside, on and past the attention's key
// blocks of 128 (kernels.h kAttentionKeys).
TEST_CASE("the KV-cached decoder's logits, one token at a time, equal a prefill of the whole sequence") {
  for (const char* name : {"tiny", "llama-tiny", "mixtral-tiny"}) {
    for (const int kv : {0, 1}) {
      for (const bool tied : {true, false}) {
        trn::model::Config c = trn::model::preset(name);
        c.ctx = 300;
        if (c.arch == "gpt2" && (kv != 0 || !tied)) continue;
        if (c.arch == "mixtral" && (kv != 0 || tied)) continue;  // its preset: Llama's attention, untied
        if (c.arch == "llama") {
          if (kv) c.n_kv_head = kv;
          c.tie_embeddings = tied;
        }
        INFO(c.describe());
        const trn::model::ParamLayout lay(c);
        std::vector<float> p(lay.total());
        std::mt19937 rng(42);
        std::normal_distribution<float> normal(0.0f, 0.1f);
        for (auto& x : p) x = normal(rng);
        const auto& family = trn::model::family(c.arch);
        auto whole = family.make_decoder(lay, p.data()), step = family.make_decoder(lay, p.data());
        std::vector<int32_t> tok(300);
        for (size_t i = 0; i < tok.size(); ++i) tok[i] = int32_t((i * 37 + 11) % 256);
        std::vector<float> a(c.vocab), b(c.vocab);
        for (const int n : {1, 17, 128, 129, 300}) {  // prefixes: the cache of a prefill continues like any other
          whole->reset();
          whole->append(tok.data(), n, a.data());
          step->reset();
          for (int i = 0; i < n; ++i) step->append(&tok[i], 1, b.data());
          CHECK(step->position() == n);
          float worst = 0;
          for (int v = 0; v < c.vocab; ++v) worst = std::max(worst, std::abs(a[v] - b[v]));
          INFO("prefix " << n);
          CHECK(worst < 1e-4f);
        }
        // A prefill of a prefix, single tokens, then a prefill of the rest: the same as one prefill.
        step->reset();
        step->append(tok.data(), 25, b.data());
        for (int i = 25; i < 140; ++i) step->append(&tok[i], 1, b.data());
        step->append(tok.data() + 140, 160, b.data());  // a prefill over a cache of 140
        float worst = 0;
        for (int v = 0; v < c.vocab; ++v) worst = std::max(worst, std::abs(a[v] - b[v]));
        CHECK(worst < 1e-4f);
      }
    }
  }
}

TEST_CASE("a Mixtral's greedy logits from trn-generate equal trn-train's forward of the same tokens") {
  // Two mixtral-tiny models trained a few steps: top-2 renormalised, and the raw probabilities
  // with DeepSeek-V3's balancing bias (moved by every step, so the choice depends on it).
  TempDir dir;
  const std::vector<std::vector<std::string>> models = {
      {"--model", "mixtral-tiny"},
      {"--model", "mixtral-tiny", "--moe-balance", "bias", "--moe-norm-topk", "0"}};
  auto floats = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    REQUIRE(bytes.size() % sizeof(float) == 0);
    std::vector<float> out(bytes.size() / sizeof(float));
    std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  };
  for (size_t m = 0; m < models.size(); ++m) {
    const std::string name = "moe" + std::to_string(m), file = trained(dir, models[m], name);
    const std::string prompt = "Hello", gen = dir.path() + "/" + name + ".gen",
                      fwd = dir.path() + "/" + name + ".fwd";
    const int new_tokens = 8, vocab = 256;
    auto g = generate({"--model", file, "--prompt", prompt, "--max-new-tokens", std::to_string(new_tokens),
                       "--dump-logits", gen});
    INFO(g.describe());
    REQUIRE(g.ok());
    const std::vector<float> got = floats(gen);
    REQUIRE(got.size() == size_t(new_tokens) * vocab);
    // The tokens: the prompt's bytes, then each greedy choice but the last.
    std::vector<int> tokens(prompt.begin(), prompt.end());
    for (int i = 0; i + 1 < new_tokens; ++i) {
      const float* row = got.data() + size_t(i) * vocab;
      tokens.push_back(int(std::max_element(row, row + vocab) - row));
    }
    std::string ids;
    for (int t : tokens) {
      if (!ids.empty()) ids += ' ';
      ids += std::to_string(t);
    }
    auto t = run("trn-train", {"--init", file, "--seq-len", "32", "--batch-size", "1", "--steps", "1", "--lr",
                               "0", "--dump-logits", fwd, "--logits-tokens", ids});
    INFO(t.describe());
    REQUIRE(t.ok());
    const std::vector<float> want = floats(fwd);
    REQUIRE(want.size() == tokens.size() * vocab);
    // Row i of trn-generate's is the logits after prompt + i tokens: trn-train's row 4 + i.
    double worst = 0;
    for (int i = 0; i < new_tokens; ++i) {
      const float* a = got.data() + size_t(i) * vocab;
      const float* b = want.data() + (prompt.size() - 1 + size_t(i)) * vocab;
      double diff = 0, scale = 0;
      for (int v = 0; v < vocab; ++v) {
        diff = std::max(diff, std::fabs(double(a[v]) - double(b[v])));
        scale = std::max(scale, std::fabs(double(b[v])));
      }
      worst = std::max(worst, diff / scale);
    }
    INFO(name << ": worst difference over the row's largest logit " << worst);
    CHECK(worst < 1e-5);
  }
}
