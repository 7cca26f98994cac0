// trn-data with the real program on a corpus every Debian machine has (/usr/share/common-licenses):
// its token ids equal the sentencepiece Python module's, its shards pass a reader written from
// Megatron's MMIDIDX format (check_shards.py), its output is the same bytes for any --threads, and
// bad input gets one line and exit 2.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string kCorpus = "/usr/share/common-licenses/*";

ProcResult run(std::vector<std::string> argv) { return run_all({ProcSpec{std::move(argv), {}}}, 300s).at(0); }

std::vector<std::string> data(std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-data"));
  return args;
}

std::string bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write(const std::string& p, const std::string& b) { std::ofstream(p, std::ios::binary) << b; }

// The corpus files in the order trn-data reads them (sorted paths, regular files or links to one).
std::vector<std::string> corpus() {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator("/usr/share/common-licenses"))
    if (fs::is_regular_file(e.path())) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

std::string train_tokenizer(const TempDir& tmp, const std::string& type, int vocab) {
  const std::string model = tmp.path() + "/" + type + ".model";
  const auto r = run(data({"tokenizer", "train", "--input", kCorpus, "--vocab", std::to_string(vocab),
                           "--model-type", type, "--out", model}));
  INFO(r.describe());
  REQUIRE(r.ok());
  REQUIRE(fs::file_size(model) > 0);
  return model;
}

// The one line a usage error prints, after checking it is the whole output and exit 2.
std::string usage_line(const ProcResult& r) {
  INFO(r.describe());
  REQUIRE(r.exit_code == 2);
  std::string out = r.output;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  REQUIRE(out.find('\n') == std::string::npos);
  REQUIRE(out.rfind("trn-data: error: ", 0) == 0);
  return out;
}

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("trn-data's token ids equal the sentencepiece module's and its shards follow the MMIDIDX format",
          "[integration]") {
  const std::string type = GENERATE("bpe", "unigram");
  TempDir tmp;
  const std::string model = train_tokenizer(tmp, type, 2000);
  const std::string out = tmp.path() + "/shards";
  // A small shard size makes several train shards; a large val fraction puts documents in val.
  const auto r = run(data({"tokenize", "--tokenizer", model, "--input", kCorpus, "--out", out,
                           "--shard-tokens", "10000", "--val-fraction", "0.3", "--threads", "2"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(r.output.find("tokenized") != std::string::npos);
  std::vector<std::string> check = {"/usr/bin/python3",
                                    std::string(TRN_SOURCE_DIR) + "/tests/integration/data/check_shards.py",
                                    model, out};
  for (const auto& f : corpus()) check.push_back(f);
  const auto c = run(check);
  INFO(c.describe());
  REQUIRE(c.ok());
  REQUIRE(c.output.rfind("ok: ", 0) == 0);
  CHECK(c.output.find("val 0 documents") == std::string::npos);
  CHECK(c.output.find("in 1 shards, val") == std::string::npos);  // train spans several shards

  const auto i = run(data({"inspect", out, "--tokenizer", model}));
  INFO(i.describe());
  REQUIRE(i.ok());
  CHECK(i.output.find("uint16") != std::string::npos);
  CHECK(i.output.find("total: ") != std::string::npos);
  CHECK(i.output.find("decoded: ") != std::string::npos);
}

TEST_CASE("trn-data trains the same tokenizer and writes the same shards for any --threads",
          "[integration]") {
  TempDir tmp;
  const std::string model = train_tokenizer(tmp, "bpe", 1000);
  const std::string again = tmp.path() + "/again.model";
  REQUIRE(run(data({"tokenizer", "train", "--input", kCorpus, "--vocab", "1000", "--model-type", "bpe",
                    "--out", again}))
              .ok());
  CHECK(bytes(model) == bytes(again));
  for (const char* t : {"1", "2"}) {
    const auto r =
        run(data({"tokenize", "--tokenizer", model, "--input", kCorpus, "--out", tmp.path() + "/t" + t,
                  "--shard-tokens", "30000", "--val-fraction", "0.2", "--threads", t}));
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  const auto names = listing(tmp.path() + "/t1");
  REQUIRE(names == listing(tmp.path() + "/t2"));
  REQUIRE(names.size() >= 4);
  for (const auto& n : names) {
    INFO(n);
    CHECK(bytes(tmp.path() + "/t1/" + n) == bytes(tmp.path() + "/t2/" + n));
  }
}

TEST_CASE("trn-data answers bad input with one line and exit 2", "[integration]") {
  TempDir tmp;
  const std::string model = train_tokenizer(tmp, "bpe", 500);
  const std::string text = tmp.path() + "/text";
  fs::create_directories(text);

  SECTION("a file that is not UTF-8: its name and the byte offset") {
    write(text + "/a.txt", "fine text\n");
    write(text + "/b.txt", "caf\xc3\xa9 ok\nbad \xff here\n");
    const std::string want = fmt::format("{}/b.txt is not UTF-8 text (invalid byte at offset 13)", text);
    CHECK(usage_line(run(data({"tokenize", "--tokenizer", model, "--input", text + "/*", "--out",
                               tmp.path() + "/o"})))
              .find(want) != std::string::npos);
    CHECK(usage_line(run(data({"tokenizer", "train", "--input", text + "/*", "--vocab", "100", "--out",
                               tmp.path() + "/x.model"})))
              .find(want) != std::string::npos);
  }
  SECTION("an empty corpus") {
    write(text + "/empty.txt", "");
    CHECK(usage_line(run(data({"tokenize", "--tokenizer", model, "--input", text + "/*", "--out",
                               tmp.path() + "/o"})))
              .find("the corpus is empty") != std::string::npos);
    CHECK(usage_line(run(data({"tokenizer", "train", "--input", text + "/*", "--vocab", "100", "--out",
                               tmp.path() + "/x.model"})))
              .find("the corpus is empty") != std::string::npos);
    CHECK(usage_line(run(data({"tokenize", "--tokenizer", model, "--input", text + "/none-*", "--out",
                               tmp.path() + "/o"})))
              .find("matches no file") != std::string::npos);
  }
  SECTION("a vocabulary larger than the text supports") {
    write(text + "/small.txt", "a small text of few words\nand a second line\n");
    for (const char* type : {"bpe", "unigram"}) {
      INFO(type);
      const auto line = usage_line(run(data({"tokenizer", "train", "--input", text + "/*", "--vocab", "5000",
                                             "--model-type", type, "--out", tmp.path() + "/x.model"})));
      CHECK(line.find("5000") != std::string::npos);
      CHECK(!fs::exists(tmp.path() + "/x.model"));
    }
  }
  SECTION("a shard with a bad magic, or an index that disagrees with its .bin") {
    const std::string out = tmp.path() + "/shards";
    REQUIRE(
        run(data({"tokenize", "--tokenizer", model, "--input", kCorpus, "--out", out, "--val-fraction", "0"}))
            .ok());
    const std::string idx = out + "/train-00000.idx", bin_path = out + "/train-00000.bin";
    REQUIRE(run(data({"inspect", out + "/train-00000"})).ok());
    const std::string good_idx = bytes(idx), good_bin = bytes(bin_path);
    std::string bad = good_idx;
    bad[0] = 'X';
    write(idx, bad);
    CHECK(usage_line(run(data({"inspect", out}))).find("train-00000") != std::string::npos);
    write(idx, good_idx);
    write(bin_path, good_bin.substr(0, good_bin.size() - 2));
    CHECK(usage_line(run(data({"inspect", out + "/train-00000"}))).find("train-00000") != std::string::npos);
  }
}
