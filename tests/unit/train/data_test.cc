#include <catch2/catch.hpp>

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
    CHECK(size_t(at[i]) == data.data()[s1.start(5, seq) + t + 1]);
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
  CHECK(raw.data()[0] == 'h');
  std::vector<uint16_t> toks = {1, 50000, 7, 256, 0};
  data::write_llmc_bin(dir.path() + "/t.bin", toks);
  auto bin = data::Tokens::load(dir.path() + "/t.bin", 50257);
  CHECK(std::vector<uint16_t>(bin.data(), bin.data() + bin.size()) == toks);
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
