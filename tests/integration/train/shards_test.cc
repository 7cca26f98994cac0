// trn-train on Megatron indexed shards: the vocabulary comes from the shards, the token stream is
// the shards back to back, so the same tokens as one llm.c file train bit for bit the same, and
// data- and tensor-parallel layouts equal one process.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "runtime/data/data.h"
#include "runtime/data/indexed.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

ProcResult run(std::vector<std::string> argv) {
  return run_all({ProcSpec{std::move(argv), {{"TRN_LOG_LEVEL", "info"}}}}, 300s).at(0);
}

std::vector<std::string> train_cmd(const std::string& data, const std::string& out,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> c = {bin("trn-train"), "--model", "tiny", "--data", data, "--steps", "6", "--batch-size",
                                "8", "--seq-len", "32", "--lr", "1e-4", "--log-every", "3", "--seed", "7",
                                "--metrics-jsonl", out + ".jsonl", "--save", out + ".safetensors"};
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

// A token stream over ids 0..kMaxId: the built-in corpus' bytes spread over a larger vocabulary,
// so the model's vocabulary (kMaxId + 1) can only come from the shards.
constexpr int32_t kMaxId = 700;
std::vector<int32_t> stream() {
  const std::string text = trn::data::builtin_corpus_text(60000);
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = int32_t((static_cast<unsigned char>(text[i]) * 5 + i % 3) % kMaxId);
  out[100] = kMaxId;
  return out;
}

// The stream as shards DIR/train-NNNNN of documents of uneven length.
void write_shards(const std::string& dir, const std::vector<int32_t>& s) {
  size_t at = 0;
  for (int shard = 0; at < s.size(); ++shard) {
    trn::data::IndexedWriter w(fmt::format("{}/train-{:05}", dir, shard), kMaxId + 1);
    for (int d = 0; d < 5 && at < s.size(); ++d) {
      const size_t n = std::min<size_t>(500 + 311 * d, s.size() - at);
      w.add_document(s.data() + at, n);
      at += n;
    }
    w.finish();
  }
}

}  // namespace

TEST_CASE("trn-train on indexed shards: vocabulary from the data, llm.c-identical, equal across layouts") {
  TempDir dir;
  const auto s = stream();
  write_shards(dir.path(), s);
  trn::data::write_llmc_bin(dir.path() + "/flat.bin", std::vector<uint16_t>(s.begin(), s.end()));
  const std::string out = dir.path() + "/out";

  auto one = run(train_cmd(dir.path(), out + "-dir"));
  INFO(one.describe());
  REQUIRE(one.ok());
  const auto losses = jsonl_losses(out + "-dir.jsonl");
  REQUIRE(losses.size() == 6);

  // The vocabulary was the shards' (largest id + 1): the llm.c file with --vocab 701 trains the
  // same model on the same batches, bit for bit; so does a glob of the same shards.
  auto flat = run(train_cmd(dir.path() + "/flat.bin", out + "-flat", {"--vocab", std::to_string(kMaxId + 1)}));
  INFO(flat.describe());
  REQUIRE(flat.ok());
  CHECK(file_bytes(out + "-flat.safetensors") == file_bytes(out + "-dir.safetensors"));
  CHECK(jsonl_losses(out + "-flat.jsonl") == losses);
  auto glob = run(train_cmd(dir.path() + "/train-*.idx", out + "-glob"));
  INFO(glob.describe());
  REQUIRE(glob.ok());
  CHECK(file_bytes(out + "-glob.safetensors") == file_bytes(out + "-dir.safetensors"));

  for (const char* layout : {"--dp", "--tp"}) {
    auto r = run(trnrun_cmd(2, train_cmd(dir.path(), out + layout, {layout, "2"})));
    INFO(layout << ": " << r.describe());
    REQUIRE(r.ok());
    const auto got = jsonl_losses(out + layout + ".jsonl");
    REQUIRE(got.size() == losses.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO(layout << " step " << i + 1 << ": " << losses[i] << " vs " << got[i]);
      CHECK(std::abs(got[i] - losses[i]) <= 1e-5 * std::abs(losses[i]));
    }
  }

  // A resume from step 3 sees the same batches: removing the last checkpoint and running again
  // ends on the same weights.
  const std::string ck = dir.path() + "/ck";
  const auto with_ck = train_cmd(dir.path(), out + "-ck", {"--checkpoint-dir", ck, "--checkpoint-every", "3"});
  REQUIRE(run(with_ck).ok());
  REQUIRE(std::filesystem::remove_all(ck + "/step-00000006") > 0);
  auto resumed = run(with_ck);
  INFO(resumed.describe());
  REQUIRE(resumed.ok());
  CHECK_THAT(resumed.output, Catch::Contains("resumed from " + ck + "/step-00000003"));
  CHECK(file_bytes(out + "-ck.safetensors") == file_bytes(out + "-dir.safetensors"));

  // A --vocab below the data's largest id + 1 is one usage error naming both.
  expect_usage_error(run(train_cmd(dir.path(), out + "-small", {"--vocab", "600"})),
                     {"largest token id is 700", "vocabulary is 600", "--vocab 701"});
}
