#include <catch2/catch.hpp>

#include <dirent.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>

#include "collectives/core/error.h"
#include "runtime/data/indexed.h"
#include "tests/support/process.h"

using namespace trn;

namespace {
std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void put(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }
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
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.push_back(e->d_name);
  ::closedir(d);
  return out;
}
// Little-endian fields appended to a byte string, written out from the format's specification.
template <typename T>
void le(std::string* s, T v) {
  for (size_t i = 0; i < sizeof v; ++i) s->push_back(char((uint64_t(v) >> (8 * i)) & 0xff));
}
const std::vector<std::vector<int32_t>> kDocs = {{1, 2, 3}, {}, {40, 999}, {7}};
}  // namespace

TEST_CASE("an indexed dataset round-trips through the writer and the reader, uint16 and int32") {
  test::TempDir dir;
  for (int64_t vocab : {1000, 70000}) {
    const std::string prefix = dir.path() + "/v" + std::to_string(vocab);
    std::vector<std::vector<int32_t>> docs = kDocs;
    if (vocab > 65535) docs[2].push_back(69999);
    {
      data::IndexedWriter w(prefix, vocab);
      for (const auto& d : docs) w.add_document(d.data(), d.size());
      CHECK(w.documents() == 4);
      w.finish();
    }
    const auto ds = data::IndexedDataset::open(prefix);
    CHECK(ds.dtype() == (vocab == 1000 ? 8 : 4));
    CHECK(ds.dtype() == data::dtype_for_vocab(vocab));
    CHECK(ds.sequences() == 4);
    CHECK(ds.documents() == 4);
    std::vector<int32_t> stream;
    for (size_t i = 0; i < docs.size(); ++i) {
      std::vector<int32_t> got;
      ds.read(i, &got);
      CHECK(got == docs[i]);
      stream.insert(stream.end(), docs[i].begin(), docs[i].end());
    }
    REQUIRE(ds.tokens() == stream.size());
    for (size_t t = 0; t < stream.size(); ++t) CHECK(ds.token(t) == stream[t]);
    std::vector<int32_t> part(3);
    ds.read_tokens(2, 3, part.data());
    CHECK(part == std::vector<int32_t>(stream.begin() + 2, stream.begin() + 5));
    CHECK(ds.max_token() == (vocab == 1000 ? 999 : 69999));
  }
  CHECK(data::dtype_for_vocab(65499) == 8);
  CHECK(data::dtype_for_vocab(65500) == 4);
}

TEST_CASE("the writer's .idx and .bin are byte for byte the MMIDIDX specification") {
  test::TempDir dir;
  const std::string prefix = dir.path() + "/s";
  data::IndexedWriter w(prefix, 1000);
  for (const auto& d : kDocs) w.add_document(d.data(), d.size());
  w.finish();
  // magic, version 1, dtype 8 (uint16), S = 4, D = 5, sizes, byte pointers, doc_idx 0..4.
  std::string idx("MMIDIDX\0\0", 9);
  le<uint64_t>(&idx, 1);
  le<uint8_t>(&idx, 8);
  le<uint64_t>(&idx, 4);
  le<uint64_t>(&idx, 5);
  for (int32_t s : {3, 0, 2, 1}) le<int32_t>(&idx, s);
  for (int64_t p : {0, 6, 6, 10}) le<int64_t>(&idx, p);
  for (int64_t d : {0, 1, 2, 3, 4}) le<int64_t>(&idx, d);
  CHECK(slurp(prefix + ".idx") == idx);
  std::string bin;
  for (const auto& d : kDocs)
    for (int32_t t : d) le<uint16_t>(&bin, uint16_t(t));
  CHECK(slurp(prefix + ".bin") == bin);
  CHECK(entries(dir.path()).size() == 2);  // no temporary file left
}

TEST_CASE("a shard written elsewhere with several sequences per document reads") {
  test::TempDir dir;
  const std::string prefix = dir.path() + "/m";
  std::string idx("MMIDIDX\0\0", 9), bin;
  le<uint64_t>(&idx, 1);
  le<uint8_t>(&idx, 4);  // int32
  le<uint64_t>(&idx, 3);
  le<uint64_t>(&idx, 3);
  for (int32_t s : {2, 1, 2}) le<int32_t>(&idx, s);
  for (int64_t p : {0, 8, 12}) le<int64_t>(&idx, p);
  for (int64_t d : {0, 2, 3}) le<int64_t>(&idx, d);
  for (int32_t t : {5, 6, 7, 8, 100000}) le<int32_t>(&bin, t);
  put(prefix + ".idx", idx);
  put(prefix + ".bin", bin);
  const auto ds = data::IndexedDataset::open(prefix);
  CHECK(ds.sequences() == 3);
  CHECK(ds.documents() == 2);
  CHECK(ds.tokens() == 5);
  CHECK(ds.token(4) == 100000);
  CHECK(ds.max_token() == 100000);
}

TEST_CASE("a writer destroyed before finish leaves nothing behind") {
  test::TempDir dir;
  {
    data::IndexedWriter w(dir.path() + "/x", 1000);
    const int32_t t[] = {1, 2};
    w.add_document(t, 2);
  }
  CHECK(entries(dir.path()).empty());
  data::IndexedWriter w(dir.path() + "/y", 10);
  const int32_t bad[] = {3, 10};
  CHECK_THAT(error_of([&] { w.add_document(bad, 2); }), Catch::Contains("outside the vocabulary 0..9"));
}

TEST_CASE("every corruption of a shard is its own usage error naming the file") {
  test::TempDir dir;
  const std::string prefix = dir.path() + "/c";
  {
    data::IndexedWriter w(prefix, 1000);
    for (const auto& d : kDocs) w.add_document(d.data(), d.size());
    w.finish();
  }
  const std::string idx = slurp(prefix + ".idx"), bin = slurp(prefix + ".bin");
  const size_t sizes = 34, pointers = sizes + 4 * 4, doc = pointers + 8 * 4;
  auto with = [&](size_t at, std::string field) {
    std::string s = idx;
    s.replace(at, field.size(), field);
    return s;
  };
  auto u64 = [](uint64_t v) {
    std::string s;
    le(&s, v);
    return s;
  };
  struct Case {
    std::string idx, bin, expect;
  };
  const std::vector<Case> cases = {
      {with(0, "MMIDIDY"), bin, "bad magic"},
      {idx.substr(0, 20), bin, "shorter than the 34-byte header"},
      {with(9, u64(2)), bin, "version 2 is not supported"},
      {with(17, std::string(1, '\x06')), bin, "dtype code 6 (float64) is not a token type"},
      {with(17, std::string(1, '\x09')), bin, "dtype code 9 (unknown)"},
      {idx.substr(0, idx.size() - 1), bin, "4 sequences and 5 document indices need 122"},
      {with(18, u64(1000)), bin, "need more"},
      {with(sizes, std::string("\xff\xff\xff\xff", 4)), bin, "sequence 0 has negative size -1"},
      {with(pointers + 8, u64(4)), bin, "sequence 1 starts at byte 4, but the sizes before it end at byte 6"},
      {idx, bin.substr(0, bin.size() - 2), "add up to 12 bytes of uint16, but " + prefix + ".bin is 10 bytes"},
      {idx, bin + "xy", "is 14 bytes"},
      {with(doc, u64(1)), bin, "document index 0 is 1, out of order"},
      {with(doc + 16, u64(0)), bin, "document index 2 is 0, out of order"},
      {with(doc + 32, u64(3)), bin, "the last document index is 3, expected the sequence count 4"},
  };
  for (const auto& c : cases) {
    put(prefix + ".idx", c.idx);
    put(prefix + ".bin", c.bin);
    const std::string e = error_of([&] { data::IndexedDataset::open(prefix); });
    INFO(e);
    CHECK_THAT(e, Catch::Contains(c.expect));
    CHECK_THAT(e, Catch::Contains(prefix + "."));
  }
  ::unlink((prefix + ".bin").c_str());
  put(prefix + ".idx", idx);
  CHECK_THAT(error_of([&] { data::IndexedDataset::open(prefix); }),
             Catch::Contains("cannot read dataset file " + prefix + ".bin"));
}
