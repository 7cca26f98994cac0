// A trn-data dataset directory is a unit: readers refuse one that is unfinished (its marker
// file), incomplete, damaged or mixed with files its manifest does not name, and read a
// directory without a manifest (a user's own Megatron shards) as it is.
#include "runtime/data/dataset_dir.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "collectives/core/error.h"
#include "runtime/data/data.h"
#include "runtime/data/indexed.h"
#include "tests/support/process.h"

using namespace trn;
namespace fs = std::filesystem;

namespace {

void shard(const std::string& prefix, std::vector<int32_t> tokens) {
  data::IndexedWriter w(prefix, 1000);
  w.add_document(tokens.data(), tokens.size());
  w.finish();
}

// A dataset as tokenize leaves it: train-00000, train-00001, val-00000 and the manifest.
std::string dataset(const test::TempDir& tmp) {
  const std::string d = tmp.path() + "/ds";
  fs::create_directories(d);
  shard(d + "/train-00000", {1, 2, 3, 4});
  shard(d + "/train-00001", {5, 6, 7});
  shard(d + "/val-00000", {8, 9});
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  data::write_dataset_manifest(d, names);
  return d;
}

std::string load_error(const std::string& spec, const std::string& flag = "--data",
                       const std::string& name = "train") {
  try {
    data::Tokens::load(spec, 1000, flag, name);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    const std::string m = e.what();
    CHECK(m.find('\n') == std::string::npos);
    return m;
  }
  return "accepted";
}

void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

}  // namespace

TEST_CASE("a complete dataset directory reads through its directory, a glob or one shard") {
  test::TempDir tmp;
  const std::string d = dataset(tmp);
  CHECK(data::Tokens::load(d, 1000).size() == 7);
  CHECK(data::Tokens::load(d, 1000, "--val-data", "val").size() == 2);
  CHECK(data::Tokens::load(d + "/train-*.bin", 1000).size() == 7);
  CHECK(data::Tokens::load(d + "/train-00001", 1000).size() == 3);
  CHECK(data::dataset_vocab(d) == 8);
  REQUIRE(data::check_dataset_dir(d, "--data").has_value());
  CHECK(data::check_dataset_dir(d, "--data")->size() == 6);
}

TEST_CASE("a dataset directory with a file its manifest does not name is refused, however it is named") {
  test::TempDir tmp;
  const std::string d = dataset(tmp);
  shard(d + "/train-00002", {1, 1, 1});  // another run's shard, copied in
  for (const std::string& spec : {d, d + "/train-*.bin", d + "/train-00000"}) {
    INFO(spec);
    const std::string e = load_error(spec);
    CHECK_THAT(e, Catch::Contains("--data: " + d +
                                  " holds train-00002.bin, which its manifest trn-dataset.json does "
                                  "not name"));
  }
  CHECK_THAT(load_error(d, "--val-data", "val"), Catch::Contains("train-00002.bin"));
}

TEST_CASE("an incomplete or damaged dataset directory is refused") {
  test::TempDir tmp;
  const std::string d = dataset(tmp);
  SECTION("a shard the manifest names is missing") {
    fs::remove(d + "/train-00001.idx");
    fs::remove(d + "/train-00001.bin");
    CHECK_THAT(load_error(d),
               Catch::Contains("is incomplete: train-00001.bin, named by its manifest, is missing"));
  }
  SECTION("a shard of another size") {
    fs::resize_file(d + "/val-00000.bin", 2);
    CHECK_THAT(load_error(d), Catch::Contains("val-00000.bin has 2 bytes, its manifest says 4"));
  }
  SECTION("a shard of the same size with other bytes") {
    std::fstream f(d + "/train-00000.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(0);
    f.put('\x07');
    f.close();
    CHECK_THAT(load_error(d), Catch::Contains("train-00000.bin is damaged: its bytes do not match the hash"));
  }
  SECTION("a manifest that is not one") {
    put(d + "/trn-dataset.json",
        "{\"format\": \"trn-dataset\", \"version\": 1, \"files\": [{\"name\": \"../x\", "
        "\"bytes\": 1, \"xxh64\": 2}]}");
    CHECK_THAT(load_error(d), Catch::Contains("damaged dataset manifest") && Catch::Contains("\"../x\""));
    put(d + "/trn-dataset.json", "[]");
    CHECK_THAT(load_error(d),
               Catch::Contains("damaged dataset manifest") && Catch::Contains("not a JSON object"));
  }
}

TEST_CASE("an unfinished tokenize output is refused whatever it holds") {
  test::TempDir tmp;
  const std::string d = dataset(tmp);
  put(d + "/" + data::kDatasetPartial, "");
  for (const std::string& spec : {d, d + "/train-00000"})
    CHECK_THAT(load_error(spec), Catch::Contains(d + " is an unfinished trn-data tokenize output"));
  fs::remove(d + "/trn-dataset.json");
  CHECK_THAT(load_error(d), Catch::Contains("unfinished"));
}

TEST_CASE("a directory without a manifest (a user's own Megatron shards) is read as it is") {
  test::TempDir tmp;
  const std::string d = tmp.path() + "/megatron";
  fs::create_directories(d);
  shard(d + "/train-00000", {1, 2, 3});
  shard(d + "/corpus_text_document", {4, 5});
  put(d + "/README", "notes");
  CHECK(!data::check_dataset_dir(d, "--data").has_value());
  CHECK(data::Tokens::load(d, 1000).size() == 3);
  CHECK(data::Tokens::load(d + "/corpus_text_document", 1000).size() == 2);
}
