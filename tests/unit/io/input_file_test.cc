// Every reader of a path refuses a FIFO (or another non-regular file) in one line instead of
// blocking on it: shards, llm.c and raw data, tokenizers, safetensors, checkpoint manifests and
// --init files all open through io::InputFile.
//
// Each read runs in a child process with a deadline, so a reader that blocks fails the test
// instead of hanging it.
#include "runtime/io/input_file.h"

#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "collectives/core/error.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/data/data.h"
#include "runtime/data/indexed.h"
#include "runtime/data/tokenizer.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/one_stage.h"
#include "tests/support/process.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

const model::Config kCfg{1, 2, 4, 4, 8};

// The readers, by name: each reads path as the runtime does.
const std::map<std::string, std::function<void(const std::string&)>>& readers() {
  static const std::map<std::string, std::function<void(const std::string&)>> r = {
      {"input file", [](const std::string& p) { io::read_input_file("input file", p); }},
      {"--init check", [](const std::string& p) { io::check_readable_file("--init", p); }},
      {"safetensors", [](const std::string& p) { io::SafetensorsFile f(p); }},
      {"safetensors metadata", [](const std::string& p) { io::read_safetensors_metadata(p); }},
      {"load_gpt2",
       [](const std::string& p) {
         model::ParamLayout lay(kCfg);
         std::vector<float> w(lay.total());
         io::load_gpt2(p, lay, w.data());
       }},
      {"llm.c data", [](const std::string& p) { data::Tokens::load(p, 256); }},
      {"tokenizer", [](const std::string& p) { data::Tokenizer::load(p); }},
      // p is a shard prefix whose .bin is the FIFO.
      {"shard", [](const std::string& p) { data::IndexedDataset::open(p); }},
      {"shard directory", [](const std::string& p) { data::Tokens::load(p, 1 << 20); }},
      // p is a checkpoint step directory whose manifest.json is the FIFO.
      {"checkpoint", [](const std::string& p) { checkpoint::verify(p); }},
  };
  return r;
}

}  // namespace

// Runs readers()[args[0]] on args[1]; prints the usage error and exits 2, or exits 0.
TRN_TEST_CHILD(read_path) {
  try {
    readers().at(args.at(0))(args.at(1));
  } catch (const Error& e) {
    std::printf("%s: %s\n", to_string(e.kind()), e.what());
    return e.kind() == ErrorKind::kUsage ? 2 : 1;
  }
  return 0;
}

// The newest committed checkpoint of a run, where the newest step's manifest is a FIFO.
TRN_TEST_CHILD(latest_of_run) {
  const std::string run = "run-1";
  const auto l = checkpoint::latest(args.at(0), &run);
  std::printf("latest: %s\n", l ? l->c_str() : "none");
  return 0;
}

namespace {

test::ProcResult read_in_child(const std::string& reader, const std::string& path) {
  return test::run_all({test::child("read_path", {reader, path})}, 20s).at(0);
}

void fifo(const std::string& path) { REQUIRE(::mkfifo(path.c_str(), 0644) == 0); }

void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void expect_refused(const test::ProcResult& r, const std::string& path) {
  INFO(r.describe());
  REQUIRE(!r.timed_out);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find(path + " is a FIFO, not a regular file") != std::string::npos);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}

}  // namespace

TEST_CASE("every reader refuses a FIFO in one line instead of blocking on it") {
  test::TempDir dir;
  const std::string f = dir.path() + "/pipe";
  fifo(f);
  for (const char* reader : {"input file", "--init check", "safetensors", "safetensors metadata", "load_gpt2",
                             "llm.c data", "tokenizer"}) {
    INFO(reader);
    expect_refused(read_in_child(reader, f), f);
  }
}

TEST_CASE("a shard whose .bin is a FIFO is refused, alone or in a directory") {
  test::TempDir dir;
  // A valid index of one sequence of 3 uint16 tokens, and its .bin a FIFO.
  {
    data::IndexedWriter w(dir.path() + "/good", 100);
    const int32_t t[3] = {1, 2, 3};
    w.add_document(t, 3);
    w.finish();
  }
  const std::string shards = dir.path() + "/shards";
  std::filesystem::create_directories(shards);
  std::filesystem::copy_file(dir.path() + "/good.idx", shards + "/train-00000.idx");
  fifo(shards + "/train-00000.bin");
  expect_refused(read_in_child("shard", shards + "/train-00000"), shards + "/train-00000.bin");
  expect_refused(read_in_child("shard directory", shards), shards + "/train-00000.bin");
}

TEST_CASE("a checkpoint whose manifest is a FIFO is refused, and passed over when looking for the latest") {
  test::TempDir dir;
  const std::string step = checkpoint::step_dir(dir.path(), 3);
  std::filesystem::create_directories(step);
  fifo(step + "/manifest.json");
  expect_refused(read_in_child("checkpoint", step), step + "/manifest.json");
  const auto r = test::run_all({test::child("latest_of_run", {dir.path()})}, 60s).at(0);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(r.output.find("latest: none") != std::string::npos);
}

TEST_CASE("InputFile reads a regular file whole and names what it refuses") {
  test::TempDir dir;
  const std::string p = dir.path() + "/f";
  put(p, "hello");
  const io::InputFile in("thing", p);
  CHECK(in.size() == 5);
  CHECK(in.read_all() == "hello");
  CHECK(io::read_input_file("thing", p) == "hello");
  try {
    io::InputFile d("thing", dir.path());
    FAIL("a directory was opened");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("thing " + dir.path() + " is a directory; give a file"));
  }
  try {
    io::InputFile d("thing", dir.path() + "/missing");
    FAIL("a missing file was opened");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("cannot read thing " + dir.path() + "/missing: No such file"));
  }
  try {
    io::InputFile d("thing", "/dev/null");
    FAIL("a device was opened");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("/dev/null is a character device, not a regular file"));
  }
}
