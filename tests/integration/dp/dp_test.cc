// Data-parallel training end to end with the real programs: trnrun (embedded coordinator) or
// mpirun starts trn-train workers that bootstrap the fabric and all-reduce gradients. Their
// per-step losses must match a one-process run over the same global batch.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> trnrun(int n, const std::vector<std::string>& p) { return trnrun_cmd(n, p); }
std::vector<double> losses(const std::string& f) { return jsonl_losses(f); }

const std::vector<std::string> kTrainArgs = {"--model", "tiny", "--steps", "30", "--batch-size", "8",
                                             "--seq-len", "64", "--log-every", "10", "--bucket-mb", "0.25"};

std::vector<std::string> train_cmd(const std::string& metrics, std::vector<std::string> extra = {}) {
  std::vector<std::string> c = {bin("trn-train")};
  c.insert(c.end(), kTrainArgs.begin(), kTrainArgs.end());
  c.insert(c.end(), {"--metrics-jsonl", metrics});
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}



void check_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == 30);
  REQUIRE(b.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1 << ": " << a[i] << " vs " << b[i]);
    CHECK(std::abs(a[i] - b[i]) <= rel * std::abs(a[i]));
  }
}

ProcResult run(std::vector<std::string> argv, std::map<std::string, std::string> env = {}) {
  return run_all({ProcSpec{std::move(argv), std::move(env)}}, 240s).at(0);
}

std::vector<double> one_process_losses(const TempDir& dir) {
  auto r = run(train_cmd(dir.path() + "/one.jsonl"));
  INFO(r.describe());
  REQUIRE(r.ok());
  return losses(dir.path() + "/one.jsonl");
}

}  // namespace

TEST_CASE("trnrun with two data-parallel workers matches one process") {
  TempDir dir;
  auto one = one_process_losses(dir);
  auto r = run(trnrun(2, train_cmd(dir.path() + "/dp.jsonl", {"--dp", "2"})));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("[rank 0]"));
  CHECK_THAT(r.output, Catch::Contains("[rank 1]"));
  CHECK_THAT(r.output, Catch::Contains("final weights identical on all 2 data-parallel replicas"));
  check_close(one, losses(dir.path() + "/dp.jsonl"), 1e-5);
  CHECK(one.back() < one.front() - 1.0);  // it learns
}

TEST_CASE("bf16 gradient all-reduce stays close to f32") {
  TempDir dir;
  auto one = one_process_losses(dir);
  auto r = run(trnrun(2, train_cmd(dir.path() + "/bf16.jsonl", {"--dp", "2", "--grad-comm", "bf16"})));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("final weights identical on all 2 data-parallel replicas"));
  auto bf16 = losses(dir.path() + "/bf16.jsonl");
  check_close(one, bf16, 1e-2);
  bool differs = false;  // the bf16 path really ran
  for (size_t i = 0; i < one.size(); ++i) differs |= one[i] != bf16[i];
  CHECK(differs);
}

TEST_CASE("mpirun starts the same data-parallel job", "[mpi]") {
  TempDir dir;
  auto a = run(trnrun(2, train_cmd(dir.path() + "/trnrun.jsonl", {"--dp", "2"})));
  INFO(a.describe());
  REQUIRE(a.ok());
  std::vector<std::string> mpi = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"};
  auto prog = train_cmd(dir.path() + "/mpirun.jsonl", {"--dp", "2"});
  mpi.insert(mpi.end(), prog.begin(), prog.end());
  auto b = run(mpi, {{"OMPI_MCA_btl", "self,tcp"}});
  INFO(b.describe());
  REQUIRE(b.ok());
  CHECK_THAT(b.output, Catch::Contains("connected via mpirun"));
  check_close(losses(dir.path() + "/trnrun.jsonl"), losses(dir.path() + "/mpirun.jsonl"), 1e-5);
}

TEST_CASE("a layout that does not match the job is one clear error") {
  TempDir dir;
  auto r = run(trnrun(2, train_cmd(dir.path() + "/x.jsonl", {"--dp", "3", "--batch-size", "6"})));
  CHECK_FALSE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("--dp 3 --tp 1 --pp 1 needs 3 workers but the job has 2"));
}

TEST_CASE("the all-reduce hello world example runs under trnrun with 3 workers") {
  auto r = run(trnrun(3, {bin("example_allreduce_hello")}));
  INFO(r.describe());
  REQUIRE(r.ok());
  for (int rank = 0; rank < 3; ++rank)
    CHECK_THAT(r.output, Catch::Contains(fmt::format("rank {} of 3: sum of ranks = 3 (expected 3)", rank)));
}
