// --state-dir's change log with no coordinator: records round-trip, corruption of any kind is a
// usage error naming the file, a record cut short at the end is dropped, and compaction keeps
// the log within a constant factor of the live state.
#include "launcher/server/state_dir.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "collectives/core/error.h"
#include "tests/support/process.h"

using namespace trn;
using namespace trn::control;
namespace v1 = ::trn::coordinator::v1;

namespace {

v1::LogRecord job_record(const std::string& id, int64_t generation, int64_t seq = 1) {
  v1::LogRecord r;
  r.set_next_event_seq(seq);
  r.mutable_job()->set_job_id(id);
  r.mutable_job()->set_generation(generation);
  r.mutable_job()->set_state("running");
  return r;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spit(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}

std::string load_error(const std::string& dir) {
  try {
    StateDir sd(dir);
    sd.load();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("state log: changes and removals survive a reload, newest record of a job wins") {
  test::TempDir dir;
  {
    StateDir sd(dir.path());
    CHECK(sd.load().jobs_size() == 0);
    sd.append(job_record("a", 0));
    sd.append(job_record("b", 0));
    sd.append(job_record("a", 3, 17));
    v1::LogRecord rm;
    rm.set_removed_job("b");
    sd.append(rm);
  }
  StateDir sd(dir.path());
  auto snap = sd.load();
  REQUIRE(snap.jobs_size() == 1);
  CHECK(snap.jobs(0).job_id() == "a");
  CHECK(snap.jobs(0).generation() == 3);
  CHECK(snap.next_event_seq() == 17);
}

TEST_CASE("state log: a flipped bit, an empty file, a wrong header or a directory is refused") {
  test::TempDir dir;
  std::string log = dir.path() + "/state.log";
  {
    StateDir sd(dir.path());
    sd.load();
    sd.append(job_record("some-job-with-a-long-name", 5));
  }
  std::string good = slurp(log);
  for (size_t bit : {size_t{8 * 8 + 3}, size_t{8 * 20 + 1}, 8 * good.size() / 2, 8 * (good.size() - 30) + 7}) {
    std::string bad = good;
    bad[bit / 8] = static_cast<char>(bad[bit / 8] ^ (1 << (bit % 8)));
    spit(log, bad);
    INFO("bit " << bit);
    CHECK_THAT(load_error(dir.path()), Catch::Contains("checksum") && Catch::Contains(log));
  }
  spit(log, "");
  CHECK_THAT(load_error(dir.path()), Catch::Contains("empty (0 bytes)"));
  spit(log, "not a log at all");
  CHECK_THAT(load_error(dir.path()), Catch::Contains("header"));
  std::filesystem::remove(log);
  std::filesystem::create_directory(log);
  CHECK_THAT(load_error(dir.path()), Catch::Contains("not a regular file"));
  std::filesystem::remove(log);
  spit(dir.path() + "/file", "x");
  CHECK_THAT(load_error(dir.path() + "/file"), Catch::Contains("not a directory"));
}

TEST_CASE("state log: a last record cut short (a crash mid-append) is dropped, the rest loads") {
  test::TempDir dir;
  std::string log = dir.path() + "/state.log";
  {
    StateDir sd(dir.path());
    sd.load();
    sd.append(job_record("kept", 1));
  }
  size_t kept_size = slurp(log).size();
  {
    StateDir sd(dir.path());
    sd.load();
    sd.append(job_record("torn", 2));
  }
  std::string data = slurp(log);
  REQUIRE(data.size() > kept_size + 6);
  for (size_t cut : {size_t{3}, size_t{12}, data.size() - kept_size - 1}) {
    INFO("cut " << cut);
    // Keep the compacted prefix plus part of the appended record.
    std::string partial = data.substr(0, data.size() - cut);
    spit(log, partial);
    StateDir sd(dir.path());
    auto snap = sd.load();
    bool has_kept = false;
    for (const auto& j : snap.jobs()) has_kept |= j.job_id() == "kept";
    CHECK(has_kept);
  }
}

TEST_CASE("state log: compaction keeps the log within a constant factor of the live state") {
  test::TempDir dir;
  StateDir sd(dir.path());
  sd.load();
  uint64_t most = 0;
  for (int i = 0; i < 20000; ++i) {
    sd.append(job_record(fmt::format("job-{}", i % 50), i));
    most = std::max(most, sd.log_bytes());
  }
  CHECK(most <= 2 * sd.live_bytes() + (1u << 20) + 4096);
  CHECK(std::filesystem::file_size(sd.path()) == sd.log_bytes());
  StateDir again(dir.path());
  CHECK(again.load().jobs_size() == 50);
}
