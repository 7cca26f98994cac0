#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "collectives/core/error.h"
#include "runtime/data/data.h"
#include "tests/support/process.h"

using namespace trn;

namespace {
void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  FAIL("no error");
  return "";
}
}  // namespace

TEST_CASE("the batch of a step is a pure function of (seed, step); dp ranks take slices") {
  const auto data = data::Tokens::builtin();
  data::Sampler s1(data, 16, 42), s2(data, 16, 42), other(data, 16, 43);
  const int B = 8;
  std::vector<int32_t> a(B * 16), at(B * 16), b(B * 16), bt(B * 16);
  s1.fill(5, 0, B, a.data(), at.data());
  s1.fill(6, 0, B, b.data(), bt.data());  // another step first: no hidden state
  s2.fill(5, 0, B, b.data(), bt.data());
  CHECK(a == b);
  CHECK(at == bt);
  other.fill(5, 0, B, b.data(), bt.data());
  CHECK(a != b);
  for (int i = 0; i < B * 16; ++i) {  // targets are the next tokens
    const size_t seq = i / 16, t = i % 16;
    CHECK(at[i] == data[s1.start(5, seq) + t + 1]);
  }
  for (int dp : {2, 4}) {  // rank r of dp gets [r*B/dp, (r+1)*B/dp)
    std::vector<int32_t> joined, part(B / dp * 16), pt(part.size());
    for (int r = 0; r < dp; ++r) {
      s1.fill(5, r * B / dp, B / dp, part.data(), pt.data());
      joined.insert(joined.end(), part.begin(), part.end());
    }
    CHECK(joined == a);
  }
}

TEST_CASE("the built-in corpus is deterministic text") {
  const std::string a = data::builtin_corpus_text(4096), b = data::builtin_corpus_text(4096);
  CHECK(a == b);
  CHECK(a.size() == 4096);
  CHECK(a.find("the ") != std::string::npos);
  CHECK(a.find(" plus ") != std::string::npos);
}

TEST_CASE("raw bytes and llm.c .bin files load") {
  test::TempDir dir;
  write(dir.path() + "/raw.txt", "hello world");
  auto raw = data::Tokens::load(dir.path() + "/raw.txt", 256);
  REQUIRE(raw.size() == 11);
  CHECK(raw[0] == 'h');
  std::vector<uint16_t> toks = {1, 50000, 7, 256, 0};
  data::write_llmc_bin(dir.path() + "/t.bin", toks);
  auto bin = data::Tokens::load(dir.path() + "/t.bin", 50257);
  std::vector<int32_t> got(bin.size());
  bin.read(0, got.size(), got.data());
  CHECK(got == std::vector<int32_t>(toks.begin(), toks.end()));
  CHECK(bin.shards() == 0);
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path() + "/t.bin", 256); }),
             Catch::Contains("token 50000") && Catch::Contains("--vocab 50001"));
  // truncated .bin
  std::ifstream in(dir.path() + "/t.bin", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write(dir.path() + "/cut.bin", bytes.substr(0, bytes.size() - 3));
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path() + "/cut.bin", 50257); }),
             Catch::Contains("truncated"));
}

TEST_CASE("bad data is a usage error naming the file and the fix") {
  test::TempDir dir;
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path() + "/nope.txt", 256); }),
             Catch::Contains("nope.txt") && Catch::Contains("--data"));
  write(dir.path() + "/short.txt", "abc");
  auto t = data::Tokens::load(dir.path() + "/short.txt", 256);
  CHECK_THAT(error_of([&] { data::Sampler(t, 3, 1); }),
             Catch::Contains("fewer than one sequence"));
  CHECK_NOTHROW(data::Sampler(t, 2, 1));
}

namespace {
// Writes `stream` as indexed shards PREFIX-00000.. of `per_shard` documents of `doc` tokens.
void write_shards(const std::string& prefix, const std::vector<int32_t>& stream, size_t doc, size_t per_shard,
                  int64_t vocab) {
  size_t at = 0;
  for (int shard = 0; at < stream.size(); ++shard) {
    data::IndexedWriter w(fmt::format("{}-{:05}", prefix, shard), vocab);
    for (size_t d = 0; d < per_shard && at < stream.size(); ++d) {
      const size_t n = std::min(doc, stream.size() - at);
      w.add_document(stream.data() + at, n);
      at += n;
    }
    w.finish();
  }
}
std::vector<int32_t> all(const data::Tokens& t) {
  std::vector<int32_t> out(t.size());
  t.read(0, out.size(), out.data());
  return out;
}
}  // namespace

TEST_CASE("indexed shards are one token stream, and batch for batch the same as an llm.c file of it") {
  test::TempDir dir;
  std::vector<int32_t> stream(5000);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = int32_t((i * 7919 + i / 13) % 3001);
  stream[1234] = 3001;  // the largest id
  write_shards(dir.path() + "/train", stream, 97, 7, 4000);  // shards of 679 tokens, documents of 97
  write_shards(dir.path() + "/val", std::vector<int32_t>(100, 5), 10, 100, 4000);
  data::write_llmc_bin(dir.path() + "/flat.bin", std::vector<uint16_t>(stream.begin(), stream.end()));

  const auto from_dir = data::Tokens::load(dir.path(), 4000);
  CHECK(from_dir.shards() == 8);  // the train-* ones only
  CHECK(all(from_dir) == stream);
  CHECK(from_dir.max_token() == 3001);
  const auto from_glob = data::Tokens::load(dir.path() + "/train-0000[0-3].idx", 4000);
  CHECK(from_glob.shards() == 4);
  CHECK(all(from_glob) == std::vector<int32_t>(stream.begin(), stream.begin() + 4 * 679));
  const auto one = data::Tokens::load(dir.path() + "/train-00001.bin", 4000);
  CHECK(one.shards() == 1);
  CHECK(one[0] == stream[679]);
  CHECK(data::Tokens::load(dir.path() + "/train-00001", 4000).shards() == 1);
  CHECK(data::Tokens::load(dir.path(), 4000, "--val-data", "val").size() == 100);
  CHECK(data::dataset_vocab(dir.path()) == 3002);
  CHECK(data::dataset_vocab(dir.path() + "/flat.bin") == 0);

  // Every sequence, including those across shard boundaries, equals the flat file's.
  const auto flat = data::Tokens::load(dir.path() + "/flat.bin", 4000);
  data::Sampler a(from_dir, 64, 9), b(flat, 64, 9);
  std::vector<int32_t> ai(16 * 64), at(ai.size()), bi(ai.size()), bt(ai.size());
  for (int64_t step = 0; step < 20; ++step) {
    a.fill(step, 0, 16, ai.data(), at.data());
    b.fill(step, 0, 16, bi.data(), bt.data());
    CHECK(ai == bi);
    CHECK(at == bt);
  }
  for (size_t t = 670; t < 700; ++t) CHECK(from_dir[t] == stream[t]);

  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path(), 3001); }),
             Catch::Contains("largest token id is 3001") && Catch::Contains("vocabulary is 3001") &&
                 Catch::Contains("--vocab 3002"));
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path() + "/nothing-*.bin", 4000); }),
             Catch::Contains("--data") && Catch::Contains("matches no .bin/.idx shards"));
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path() + "/flat*", 4000); }),
             Catch::Contains("flat.bin has no") && Catch::Contains("flat.idx"));
  test::TempDir empty;
  CHECK_THAT(error_of([&] { data::Tokens::load(empty.path(), 4000); }),
             Catch::Contains("is a directory without train-*.bin shards"));
  ::unlink((dir.path() + "/train-00003.idx").c_str());
  CHECK_THAT(error_of([&] { data::Tokens::load(dir.path(), 4000); }),
             Catch::Contains("train-00003.bin has no") && Catch::Contains("train-00003.idx"));
}
