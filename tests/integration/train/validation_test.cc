// trn-train's checks of what a user hands it: flag products that overflow 32 bits, flags the
// configuration ignores, sizes out of range, a background save that fails, a stop while a
// save is in flight. Real processes throughout.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/support/jobs.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace std::chrono_literals;
using trn::test::expect_usage_error;
using trn::test::count_lines_with;
using trn::test::bin;
using trn::test::TempDir;

namespace {

trn::test::ProcResult train(std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-train"));
  return trn::test::run_all({{args, {{"TRN_LOG_LEVEL", "warn"}}}}, 120s)[0];
}

std::vector<std::string> quick(std::vector<std::string> extra) {
  std::vector<std::string> a = {"--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", "1"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

}  // namespace

TEST_CASE("products of layout flags that overflow 32 bits are one usage line") {
  // dp x micro-batches is 2^32, pp x virtual stages 2^32, dp x pp wraps to 1 in 32 bits.
  expect_usage_error(train(quick({"--dp", "65536", "--micro-batches", "65536"})),
                     {"--batch-size 4", "--dp 65536 x --micro-batches 65536"});
  expect_usage_error(train(quick({"--pp", "65536", "--schedule", "interleaved", "--virtual-stages", "65536",
                                  "--micro-batches", "65536"})),
                     {"4294967296 pipeline chunks", "2 layers"});
  expect_usage_error(train(quick({"--n-layer", "9", "--pp", "9", "--dp", "954437177", "--micro-batches", "9"})),
                     {"--dp 954437177", "--pp 9", "2147483647 workers"});
  // Siblings: more stages than layers, and a --dump-batches file larger than memory.
  expect_usage_error(train(quick({"--pp", "4"})), {"--pp 4", "4 pipeline chunks", "2 layers"});
  expect_usage_error(train(quick({"--dump-batches", "/dev/null", "--steps", "4611686018427387904"})),
                     {"--dump-batches", "GB", "--steps 4611686018427387904"});
}

TEST_CASE("a flag the configuration ignores is one warning line, and the run goes on") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--bf16-kernels", "onednn"}, "--bf16-kernels onednn has no effect with --precision fp32"},
      {{"--bf16-kernels", "emulated"}, "--bf16-kernels emulated has no effect with --precision fp32"},
      {{"--grad-comm", "fp8"}, "--grad-comm fp8 with one data-parallel replica"},
      {{"--grad-comm", "bf16"}, "--grad-comm bf16 with one data-parallel replica"},
      {{"--zero", "1"}, "--zero 1 with one data-parallel replica"},
      {{"--bucket-mb", "4"}, "--bucket-mb with one data-parallel replica"},
      {{"--lr-schedule", "constant", "--min-lr", "1e-5"}, "--min-lr has no effect with --lr-schedule constant"},
      {{"--keep-checkpoints", "2"}, "--keep-checkpoints has no effect without --checkpoint-dir"},
  };
  for (const auto& [flags, warning] : cases) {
    auto r = train(quick(flags));
    INFO(r.describe());
    CHECK(r.ok());
    CHECK(count_lines_with(r.output, " warning ") == 1);
    CHECK(count_lines_with(r.output, warning) == 1);
  }
  // Flags that take effect say nothing.
  auto r = train(quick({"--precision", "bf16", "--bf16-kernels", "emulated", "--lr-schedule", "cosine",
                        "--min-lr", "1e-5"}));
  INFO(r.describe());
  CHECK(r.ok());
  CHECK(count_lines_with(r.output, " warning ") == 0);
}

TEST_CASE("sizes out of range say what is wrong: --bucket-mb, an llm.c file of the wrong length") {
  expect_usage_error(train(quick({"--dp", "1", "--bucket-mb", "1e20"})),
                     {"--bucket-mb 1e20 is too large", "at most 1048576"});
  expect_usage_error(train(quick({"--bucket-mb", "1e-9"})), {"--bucket-mb 1e-9", "less than one fp32 gradient"});
  TempDir dir;
  // An llm.c .bin of 5000 tokens (magic, version, count, then 253 more header words).
  std::string bin_file(1024 + 2 * 5000, '\0');
  const int32_t head[3] = {20240520, 1, 5000};
  std::memcpy(bin_file.data(), head, sizeof head);
  for (size_t i = 1024; i < bin_file.size(); i += 2) bin_file[i] = char(i % 200);
  const std::string extra = dir.path() + "/extra.bin", short_by_3 = dir.path() + "/short.bin";
  std::ofstream(extra, std::ios::binary) << bin_file << 'x';
  std::ofstream(short_by_3, std::ios::binary) << bin_file.substr(0, bin_file.size() - 3);
  expect_usage_error(train(quick({"--data", extra})), {"extra.bin", "header says 5000 tokens", "11024 bytes",
                                                       "11025 bytes", "1 extra byte"});
  expect_usage_error(train(quick({"--data", short_by_3})), {"short.bin", "11021 bytes", "3 missing bytes",
                                                            "truncated"});
}

// Two ranks (TRN_STORE_DIR) checkpoint every 50 steps into a tmpfs of 8 MiB, a private mount
// (unshare -m) that holds one checkpoint of the tiny model but not two: the save at step 100
// fails on rank 0, the one rank that writes a data-parallel shard, while rank 1 waits for it.
TEST_CASE("a background save that fails stops every rank at the next step with the save's error") {
  TempDir dir;
  const std::string script = R"(set -u
B=$1; D=$2
mkdir -p "$D/ck" "$D/store"
mount -t tmpfs -o size=8m tmpfs "$D/ck" || exit 99
for r in 0 1; do
  TRN_RANK=$r TRN_WORLD_SIZE=2 TRN_STORE_DIR="$D/store" TRN_LOG_LEVEL=warn "$B/trn-train" --model tiny \
    --seq-len 32 --batch-size 4 --dp 2 --steps 100000 --checkpoint-dir "$D/ck" --checkpoint-every 50 \
    --metrics-jsonl "$D/m$r.jsonl" > "$D/out$r.txt" 2>&1 &
done
wait %1; echo "rank 0 exit $?"
wait %2; echo "rank 1 exit $?"
umount "$D/ck"
)";
  const std::string b = std::filesystem::path(bin("trn-train")).parent_path().string();
  auto r = trn::test::run_all({{{"unshare", "-m", "sh", "-c", script, "sh", b, dir.path()}, {}}}, 120s)[0];
  INFO(r.describe());
  if (r.exit_code == 99) {
    WARN("cannot mount a tmpfs here (needs CAP_SYS_ADMIN): not tested");
    return;
  }
  REQUIRE_FALSE(r.timed_out);
  CHECK_THAT(r.output, Catch::Contains("rank 0 exit 2"));
  CHECK_THAT(r.output, Catch::Contains("rank 1 exit 2"));
  for (int rank : {0, 1}) {
    const std::string out = trn::test::file_bytes(dir.path() + "/out" + std::to_string(rank) + ".txt");
    INFO("rank " << rank << ": " << out);
    CHECK_THAT(out, Catch::Contains("trn-train: error: cannot write"));
    CHECK_THAT(out, Catch::Contains("No space left on device"));
  }
  // The failure is reported before the next checkpoint is due (step 150), not by it.
  const auto losses = trn::test::jsonl_losses(dir.path() + "/m0.jsonl");
  CHECK(losses.size() >= 100);
  CHECK(losses.size() < 150);
}

TEST_CASE("SIGINT while a checkpoint is being saved names the checkpoint that committed") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  REQUIRE(::mkdir(ck.c_str(), 0755) == 0);
  // A checkpoint every step: a save is in flight at almost every step boundary.
  trn::test::Process p({{bin("trn-train"), "--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps",
                         "1000000", "--checkpoint-dir", ck, "--checkpoint-every", "1"},
                        {{"TRN_LOG_LEVEL", "warn"}}});
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (!std::ifstream(ck + "/step-00000002/manifest.json").good() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  p.signal(SIGINT);
  auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK(r.exit_code == 128 + SIGINT);
  CHECK_THAT(r.output, !Catch::Contains("nothing saved"));
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("the checkpoint of step ([0-9]+) is committed in (\\S+)\n")));
  CHECK(std::stoll(m[1]) >= 2);
  CHECK(std::ifstream(m[2].str() + "/manifest.json").good());
  CHECK(m[2].str() == ck + "/step-" + std::string(8 - std::min<size_t>(8, m[1].str().size()), '0') + m[1].str());
}

TEST_CASE("SIGINT before any checkpoint was due says nothing was saved") {
  TempDir dir;
  trn::test::Process p({{bin("trn-train"), "--model", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps",
                         "1000000", "--checkpoint-dir", dir.path(), "--checkpoint-every", "100000", "--metrics-jsonl",
                         dir.path() + "/m.jsonl"},
                        {{"TRN_LOG_LEVEL", "warn"}}});
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (trn::test::file_bytes(dir.path() + "/m.jsonl").empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  p.signal(SIGINT);
  auto r = p.wait(std::chrono::steady_clock::now() + 60s);
  INFO(r.describe());
  CHECK(r.exit_code == 128 + SIGINT);
  CHECK_THAT(r.output, Catch::Contains("nothing saved (no checkpoint was due yet in this run)"));
}
