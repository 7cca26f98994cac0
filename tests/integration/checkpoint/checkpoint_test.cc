// Sharded checkpoints with the real programs: a run killed mid-way and resumed ends with weights
// bit-identical to an uninterrupted run of the same layout; a checkpoint of one layout loads into
// another; damaged checkpoints are skipped (auto) or refused (an explicit path).
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <sstream>
#include <random>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/io/safetensors.h"
#include "tests/integration/coordinator/coordinator_process.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::string slurp(const std::string& p) { return file_bytes(p); }

const std::vector<std::string> kArgs = {"--model", "tiny", "--n-layer", "4", "--steps", "24", "--batch-size", "8",
                                        "--seq-len", "32", "--log-every", "1", "--lr", "1e-4"};

std::vector<std::string> train(std::vector<std::string> extra) {
  std::vector<std::string> c = {bin("trn-train")};
  c.insert(c.end(), kArgs.begin(), kArgs.end());
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

std::vector<std::string> trnrun(int n, const std::vector<std::string>& prog, const std::vector<std::string>& opts = {}) {
  return trnrun_cmd(n, prog, opts);
}

ProcResult run(std::vector<std::string> argv) { return run_all({ProcSpec{std::move(argv), {}}}, 300s).at(0); }


bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Starts argv, waits until its output shows `marker`, kills `pid_of(output)` (or the process).
ProcResult kill_when(const std::vector<std::string>& argv, const std::string& marker, bool kill_worker = false) {
  Process p(ProcSpec{argv, {}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (p.output_so_far().find(marker) == std::string::npos && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  if (kill_worker) {
    // "[rank 1] ... [host:PID r1 g0 ..." names the worker's pid.
    std::smatch m;
    const std::string out = p.output_so_far();
    REQUIRE(std::regex_search(out, m, std::regex("\\[rank 1\\] [^\\n]*\\[[^:\\]]+:([0-9]+) r1 g0")));
    ::kill(std::stoi(m[1]), SIGKILL);
  } else {
    p.signal(SIGKILL);
  }
  return p.wait(std::chrono::steady_clock::now() + 300s);
}

double max_abs_diff(const std::string& a, const std::string& b) {
  trn::io::SafetensorsFile fa(a), fb(b);
  double worst = 0.0;
  for (const auto& [name, ta] : fa.tensors()) {
    const auto& tb = fb.tensors().at(name);
    const size_t n = (ta.end - ta.begin) / 4;
    std::vector<float> x(n), y(n);
    std::memcpy(x.data(), fa.data(ta), n * 4);
    std::memcpy(y.data(), fb.data(tb), n * 4);
    for (size_t i = 0; i < n; ++i) worst = std::max(worst, double(std::abs(x[i] - y[i])));
  }
  return worst;
}

}  // namespace

TEST_CASE("a run killed mid-way resumes from its checkpoint to bit-identical weights") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train({"--save", dir.path() + "/straight.safetensors"})).ok());
  auto killed = kill_when(train({"--checkpoint-dir", ck, "--checkpoint-every", "4", "--save", dir.path() + "/r.safetensors"}),
                          "step 14/24");
  CHECK(killed.signal == SIGKILL);
  CHECK_FALSE(exists(dir.path() + "/r.safetensors"));
  auto resumed = run(train({"--checkpoint-dir", ck, "--checkpoint-every", "4", "--save", dir.path() + "/r.safetensors"}));
  INFO(resumed.describe());
  REQUIRE(resumed.ok());
  CHECK_THAT(resumed.output, Catch::Contains("resumed from " + ck + "/step-000000"));
  CHECK(slurp(dir.path() + "/straight.safetensors") == slurp(dir.path() + "/r.safetensors"));
  // --keep-checkpoints 3 (the default): the newest three are kept.
  CHECK(exists(ck + "/step-00000024/manifest.json"));
  CHECK(exists(ck + "/step-00000016/manifest.json"));
  CHECK_FALSE(exists(ck + "/step-00000004"));
}

TEST_CASE("trnrun restarts a killed pipeline stage from the last checkpoint, bit-identical to an uninterrupted run") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  const std::vector<std::string> pp = {"--pp", "2", "--micro-batches", "4"};
  auto base = train(pp);
  base.insert(base.end(), {"--save", dir.path() + "/straight.safetensors"});
  REQUIRE(run(trnrun(2, base)).ok());
  auto prog = train(pp);
  prog.insert(prog.end(), {"--checkpoint-dir", ck, "--checkpoint-every", "5", "--save", dir.path() + "/r.safetensors"});
  auto r = kill_when(trnrun(2, prog, {"--max-restarts", "1"}), "step 12/24", true);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("restarting the workers in a new generation"));
  CHECK_THAT(r.output, Catch::Contains("resumed from " + ck + "/step-000000"));
  CHECK(slurp(dir.path() + "/straight.safetensors") == slurp(dir.path() + "/r.safetensors"));
}

TEST_CASE("a checkpoint of tp 2 x pp 2 loads into one process and into dp 2, matching the uninterrupted run") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train({"--save", dir.path() + "/straight.safetensors", "--metrics-jsonl", dir.path() + "/straight.jsonl"})).ok());
  auto prog = train({"--tp", "2", "--pp", "2", "--micro-batches", "4", "--checkpoint-dir", ck, "--checkpoint-every", "12"});
  auto r = run(trnrun(4, prog));
  INFO(r.describe());
  REQUIRE(r.ok());
  const std::string at12 = ck + "/step-00000012";
  auto one = run(train({"--resume", at12, "--save", dir.path() + "/one.safetensors", "--metrics-jsonl",
                        dir.path() + "/one.jsonl"}));
  INFO(one.describe());
  REQUIRE(one.ok());
  CHECK_THAT(one.output, Catch::Contains("resumed from " + at12 + " at step 12"));
  CHECK(max_abs_diff(dir.path() + "/straight.safetensors", dir.path() + "/one.safetensors") <= 1e-5);
  // The resumed steps' losses are the uninterrupted run's steps 13..24.
  const auto straight = jsonl_losses(dir.path() + "/straight.jsonl"), resumed = jsonl_losses(dir.path() + "/one.jsonl");
  REQUIRE(straight.size() == 24);
  REQUIRE(resumed.size() == 12);
  for (size_t i = 0; i < 12; ++i) CHECK(std::abs(resumed[i] - straight[12 + i]) <= 1e-5 * straight[12 + i]);
  auto dp = run(trnrun(2, train({"--dp", "2", "--resume", at12, "--save", dir.path() + "/dp.safetensors"})));
  INFO(dp.describe());
  REQUIRE(dp.ok());
  CHECK(max_abs_diff(dir.path() + "/straight.safetensors", dir.path() + "/dp.safetensors") <= 1e-5);
}

TEST_CASE("damaged checkpoints: auto falls back to the previous one naming the file, an explicit path is refused") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train({"--steps", "12", "--checkpoint-dir", ck, "--checkpoint-every", "4"})).ok());
  const std::string newest = ck + "/step-00000012", shard = newest + "/rank-00000.shard";
  std::string bytes = slurp(shard);
  bytes[bytes.size() / 2] ^= 0x40;  // one flipped bit
  std::ofstream(shard, std::ios::binary) << bytes;
  auto r = run(train({"--steps", "12", "--checkpoint-dir", ck}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("skipping checkpoint " + newest));
  CHECK_THAT(r.output, Catch::Contains("rank-00000.shard fails its checksum"));
  CHECK_THAT(r.output, Catch::Contains("resumed from " + ck + "/step-00000008"));
  // An explicit path of a bad checkpoint: one line, exit 2 (step 12 was rewritten by that run;
  // truncate it instead).
  const std::string again = ck + "/step-00000012/rank-00000.shard";
  bytes = slurp(again);
  std::ofstream(again, std::ios::binary) << bytes.substr(0, bytes.size() - 100);
  auto bad = run(train({"--steps", "12", "--resume", ck + "/step-00000012"}));
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.output, Catch::Contains("rank-00000.shard has"));
  CHECK_THAT(bad.output, Catch::Contains("truncated"));
  // A directory without a manifest is not a checkpoint.
  ::mkdir((ck + "/step-00000099").c_str(), 0755);
  auto nomanifest = run(train({"--steps", "12", "--resume", ck + "/step-00000099"}));
  CHECK(nomanifest.exit_code == 2);
  CHECK_THAT(nomanifest.output, Catch::Contains("is not a committed checkpoint"));
}

TEST_CASE("trn-ckpt lists, verifies and consolidates a sharded checkpoint into the run's own saved file") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  auto prog = train({"--tp", "2", "--pp", "2", "--micro-batches", "4", "--checkpoint-dir", ck, "--checkpoint-every",
                     "12", "--save", dir.path() + "/saved.safetensors"});
  REQUIRE(run(trnrun(4, prog)).ok());
  auto ls = run({bin("trn-ckpt"), "ls", ck, "--json"});
  INFO(ls.describe());
  REQUIRE(ls.ok());
  CHECK_THAT(ls.output, Catch::Contains("\"step\":12"));
  CHECK_THAT(ls.output, Catch::Contains("\"step\":24"));
  CHECK_THAT(ls.output, Catch::Contains("dp 1 x tp 2 x pp 2"));
  auto ok = run({bin("trn-ckpt"), "verify", ck});
  CHECK(ok.exit_code == 0);
  // The newest checkpoint is the end of the run: consolidated, it is the file --save wrote.
  auto cons = run({bin("trn-ckpt"), "consolidate", ck, "--out", dir.path() + "/cons.safetensors"});
  INFO(cons.describe());
  REQUIRE(cons.ok());
  CHECK(slurp(dir.path() + "/cons.safetensors") == slurp(dir.path() + "/saved.safetensors"));
  const std::string shard = ck + "/step-00000024/rank-00003.shard";
  std::string bytes = slurp(shard);
  bytes[100] ^= 1;
  std::ofstream(shard, std::ios::binary) << bytes;
  auto bad = run({bin("trn-ckpt"), "verify", ck});
  CHECK(bad.exit_code == 1);
  CHECK_THAT(bad.output, Catch::Contains("rank-00003.shard fails its checksum"));
  CHECK_THAT(bad.output, Catch::Contains("step-00000012: ok"));
  auto usage = run({bin("trn-ckpt"), "consolidate", ck});
  CHECK(usage.exit_code == 2);
  CHECK_THAT(usage.output, Catch::Contains("--out"));
}

namespace {

// Runs `layout` under trnrun --max-restarts 3 with checkpoints every 10 of 120 steps, killing a
// random worker three times (once right after a step handed its checkpoint to the background
// writer), and checks the final file against an uninterrupted run of the same layout.
void chaos(int nproc, const std::vector<std::string>& layout, uint32_t seed, bool external_coordinator = false) {
  TempDir dir;
  std::unique_ptr<trn::test::CoordinatorProcess> coord;
  std::vector<std::string> launch = {"--max-restarts", "3"};
  if (external_coordinator) {
    ::mkdir((dir.path() + "/state").c_str(), 0755);
    coord = std::make_unique<trn::test::CoordinatorProcess>(dir.path(), std::vector<std::string>{"--state-dir", dir.path() + "/state"});
    launch.insert(launch.end(), {"--coordinator", coord->address(), "--job-id", "chaos"});
  }
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  auto args = [&](const std::string& out, bool checkpoints) {
    std::vector<std::string> c = {bin("trn-train"), "--model", "tiny", "--steps", "120", "--batch-size", "8",
                                  "--seq-len", "32", "--log-every", "1", "--save", out};
    c.insert(c.end(), layout.begin(), layout.end());
    if (checkpoints) c.insert(c.end(), {"--checkpoint-dir", ck, "--checkpoint-every", "10"});
    return c;
  };
  REQUIRE(run(trnrun(nproc, args(dir.path() + "/straight.safetensors", false))).ok());
  Process job(ProcSpec{trnrun(nproc, args(dir.path() + "/chaos.safetensors", true), launch), {}});
  std::mt19937 rng(seed);
  for (int kill = 0; kill < 3; ++kill) {
    const int gen = kill;
    // Kill 0 lands right after a checkpoint was handed over (a save in flight); the others after
    // a random number of the generation's steps.
    const int steps_first = 3 + int(rng() % 25);
    const auto until = std::chrono::steady_clock::now() + 120s;
    std::smatch m;
    std::regex pid_re(fmt::format("\\[rank ([0-9]+)\\] [^\\n]*\\[[^:\\]]+:([0-9]+) r[0-9]+ g{}", gen));
    std::vector<int> pids;
    for (;;) {
      if (std::chrono::steady_clock::now() >= until) FAIL("generation " << gen << " never got to its kill");
      const std::string out = job.output_so_far();
      const size_t gen_start = out.find(fmt::format("g{} ", gen));
      bool due = false;
      if (gen_start != std::string::npos) {
        if (kill == 0) {
          due = out.find("for its checkpoint", gen_start) != std::string::npos;
        } else {
          int steps = 0;  // progress lines of this generation (rank 0 logs every step)
          for (size_t at = out.find(" train] step ", gen_start); at != std::string::npos;
               at = out.find(" train] step ", at + 1))
            ++steps;
          due = steps >= steps_first;
        }
      }
      if (due) {
        pids.clear();
        for (std::sregex_iterator it(out.begin() + gen_start, out.end(), pid_re), end; it != end; ++it)
          pids.push_back(std::stoi((*it)[2]));
        if (!pids.empty()) break;
      }
      std::this_thread::sleep_for(2ms);
    }
    ::kill(pids[rng() % pids.size()], SIGKILL);
    if (kill == 0) {
      // Whether the save was still being written when the worker died: its commit not logged.
      const std::string out = job.output_so_far();
      std::smatch hm;
      const std::string tail = out.substr(out.find(fmt::format("g{} ", gen)));
      if (std::regex_search(tail, hm, std::regex("step ([0-9]+) blocked")))
        WARN("killed with the save of step " << hm[1] << (tail.find("checkpoint of step " + std::string(hm[1]) +
                                                                      " committed") == std::string::npos
                                                               ? " in flight"
                                                               : " already committed"));
    }
    if (coord && kill == 1) {  // the coordinator dies too, and comes back on its address with its state
      coord->kill9();
      std::this_thread::sleep_for(200ms);
      coord->restart_same_port();
    }
  }
  auto r = job.wait(std::chrono::steady_clock::now() + 300s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("restart 3 of 3"));
  CHECK(slurp(dir.path() + "/straight.safetensors") == slurp(dir.path() + "/chaos.safetensors"));
}

}  // namespace

TEST_CASE("chaos: three workers killed at random moments, the final file equals an uninterrupted run's", "[slow]") {
  SECTION("dp 2") { chaos(2, {"--dp", "2"}, 1); }
  SECTION("dp 2 x tp 2") { chaos(4, {"--dp", "2", "--tp", "2"}, 2); }
  SECTION("dp 2 x pp 2 (3D with tp 1)") { chaos(4, {"--dp", "2", "--pp", "2", "--micro-batches", "2"}, 3); }
  SECTION("dp 2 with an external coordinator killed and restarted mid-job") { chaos(2, {"--dp", "2"}, 4, true); }
}

TEST_CASE("a save into a full disk stops the run with one line and is never committed") {
  if (::geteuid() != 0) {
    WARN("skipped: mounting a small tmpfs needs root");
    return;
  }
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  // A private mount namespace with an 8 MiB tmpfs on ck: the first checkpoint of tiny (about 5 MB)
  // fits, the second does not. What is left is listed before the namespace goes away.
  const std::string script = fmt::format(
      "mount -t tmpfs -o size=8m tmpfs {0} || exit 99; {1} --model tiny --steps 30 --batch-size 8 --seq-len 32 "
      "--checkpoint-dir {0} --checkpoint-every 10; echo rc=$?; ls {0}/step-00000010/manifest.json "
      "{0}/step-00000020/manifest.json 2>&1 | sed 's/^/ls: /'",
      ck, bin("trn-train"));
  auto r = run({"unshare", "-m", "sh", "-c", script});
  INFO(r.describe());
  if (r.output.find("rc=") == std::string::npos) {
    WARN("skipped: this machine cannot mount a tmpfs in a new mount namespace");
    return;
  }
  CHECK_THAT(r.output, Catch::Contains("No space left on device"));
  CHECK_THAT(r.output, Catch::Contains("rc=2"));
  CHECK_THAT(r.output, Catch::Contains("ls: " + ck + "/step-00000010/manifest.json"));
  CHECK_THAT(r.output, Catch::Contains("step-00000020/manifest.json'"));  // ls: cannot access ... (never committed)
}

TEST_CASE("under a coordinator every rank reports its shard and trnctl checkpoints lists the committed steps") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  trn::test::CoordinatorProcess coord(dir.path(), {});
  auto prog = train({"--dp", "2", "--checkpoint-dir", ck, "--checkpoint-every", "12"});
  auto r = run(trnrun(2, prog, {"--coordinator", coord.address(), "--job-id", "ckjob"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  auto ls = run({bin("trnctl"), "--coordinator", coord.address(), "checkpoints", "ckjob", "--json"});
  INFO(ls.describe());
  REQUIRE(ls.ok());
  CHECK_THAT(ls.output, Catch::Contains("12"));
  CHECK_THAT(ls.output, Catch::Contains("24"));
  CHECK_THAT(ls.output, Catch::Contains("rank-00000.shard"));
}

TEST_CASE("truncated shards, missing shards and uncommitted directories make auto resume take the previous checkpoint") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train({"--steps", "16", "--checkpoint-dir", ck, "--checkpoint-every", "4", "--keep-checkpoints", "4"})).ok());
  // step 16: truncated; step 12: its shard missing; step 8: no manifest. Step 4 is whole.
  const std::string s16 = ck + "/step-00000016/rank-00000.shard";
  const std::string bytes = slurp(s16);
  std::ofstream(s16, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  ::unlink((ck + "/step-00000012/rank-00000.shard").c_str());
  ::unlink((ck + "/step-00000008/manifest.json").c_str());
  auto r = run(train({"--steps", "16", "--checkpoint-dir", ck, "--checkpoint-every", "4"}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("skipping checkpoint " + ck + "/step-00000016"));
  CHECK_THAT(r.output, Catch::Contains("truncated"));
  CHECK_THAT(r.output, Catch::Contains("skipping checkpoint " + ck + "/step-00000012"));
  CHECK_THAT(r.output, Catch::Contains("is missing"));
  CHECK_THAT(r.output, Catch::Contains("resumed from " + ck + "/step-00000004 at step 4"));
}

TEST_CASE("trnrun restarts a killed ZeRO-1 worker from its sharded checkpoint, bit-identical to an uninterrupted run") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  const std::vector<std::string> zero = {"--dp", "2", "--zero", "1"};
  auto base = train(zero);
  base.insert(base.end(), {"--save", dir.path() + "/straight.safetensors"});
  REQUIRE(run(trnrun(2, base)).ok());
  auto prog = train(zero);
  prog.insert(prog.end(), {"--checkpoint-dir", ck, "--checkpoint-every", "5", "--save", dir.path() + "/r.safetensors"});
  auto r = kill_when(trnrun(2, prog, {"--max-restarts", "1"}), "step 12/24", true);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("restarting the workers in a new generation"));
  CHECK_THAT(r.output, Catch::Contains("resumed from " + ck + "/step-000000"));
  CHECK(slurp(dir.path() + "/straight.safetensors") == slurp(dir.path() + "/r.safetensors"));
  // Every rank wrote its shard: each holds about half of the weights and moments.
  const std::string last = ck + "/step-00000024";
  const auto a = slurp(last + "/rank-00000.shard").size(), b = slurp(last + "/rank-00001.shard").size();
  CHECK(std::abs(double(a) - double(b)) <= 0.05 * double(a));
  CHECK_THAT(slurp(last + "/manifest.json"), Catch::Contains("\"zero\": 1"));
}

TEST_CASE("ZeRO-1 checkpoints reshard: into --zero 0 and back bit for bit, into another dp and one process to rounding") {
  TempDir dir;
  const std::string ck0 = dir.path() + "/ck0", ck1 = dir.path() + "/ck1";
  for (const auto& d : {ck0, ck1}) ::mkdir(d.c_str(), 0755);
  auto job = [&](int n, std::vector<std::string> extra) {
    auto r = run(trnrun(n, train(std::move(extra))));
    INFO(r.describe());
    REQUIRE(r.ok());
    return r;
  };
  // At dp 2 ZeRO-1 trains the very bits of the all-reduce path, so both straight runs and both
  // cross-resumed runs must end in the same file.
  job(2, {"--dp", "2", "--checkpoint-dir", ck0, "--checkpoint-every", "12", "--save", dir.path() + "/s0.safetensors",
          "--metrics-jsonl", dir.path() + "/s0.jsonl"});
  job(2, {"--dp", "2", "--zero", "1", "--checkpoint-dir", ck1, "--checkpoint-every", "12", "--save",
          dir.path() + "/s1.safetensors"});
  const std::string straight = slurp(dir.path() + "/s0.safetensors");
  CHECK(slurp(dir.path() + "/s1.safetensors") == straight);
  const std::string at0 = ck0 + "/step-00000012", at1 = ck1 + "/step-00000012";
  auto into0 = job(2, {"--dp", "2", "--resume", at1, "--save", dir.path() + "/z1to0.safetensors"});
  CHECK_THAT(into0.output, Catch::Contains("resumed from " + at1 + " at step 12"));
  CHECK(slurp(dir.path() + "/z1to0.safetensors") == straight);
  job(2, {"--dp", "2", "--zero", "1", "--resume", at0, "--save", dir.path() + "/z0to1.safetensors"});
  CHECK(slurp(dir.path() + "/z0to1.safetensors") == straight);
  // Another data-parallel width (another ZeRO partition) and one process: the same model to
  // rounding, and the resumed steps' losses are the straight run's steps 13..24.
  job(4, {"--dp", "4", "--zero", "1", "--resume", at1, "--save", dir.path() + "/dp4.safetensors"});
  CHECK(max_abs_diff(dir.path() + "/s0.safetensors", dir.path() + "/dp4.safetensors") <= 1e-5);
  auto one = run(train({"--resume", at1, "--save", dir.path() + "/one.safetensors", "--metrics-jsonl",
                        dir.path() + "/one.jsonl"}));
  INFO(one.describe());
  REQUIRE(one.ok());
  CHECK(max_abs_diff(dir.path() + "/s0.safetensors", dir.path() + "/one.safetensors") <= 1e-5);
  const auto s = jsonl_losses(dir.path() + "/s0.jsonl"), o = jsonl_losses(dir.path() + "/one.jsonl");
  REQUIRE(s.size() == 24);
  REQUIRE(o.size() == 12);
  for (size_t i = 0; i < 12; ++i) CHECK(std::abs(o[i] - s[12 + i]) <= 1e-5 * s[12 + i]);
  // trn-ckpt reads it like any other: listed with its ZeRO setting, consolidated into --save's bytes.
  auto ls = run({bin("trn-ckpt"), "ls", ck1});
  CHECK_THAT(ls.output, Catch::Contains("dp 2 x tp 1 x pp 1 (virtual stages 1), zero 1"));
  CHECK(run({bin("trn-ckpt"), "verify", ck1}).exit_code == 0);
  auto cons = run({bin("trn-ckpt"), "consolidate", ck1, "--out", dir.path() + "/cons.safetensors"});
  INFO(cons.describe());
  REQUIRE(cons.ok());
  CHECK(slurp(dir.path() + "/cons.safetensors") == straight);
  // A ZeRO-1 checkpoint without one rank's shard (its manifest edited to match, so every file
  // checks out) leaves elements uncovered: one error line, exit 2, never zeros loaded silently.
  auto man = nlohmann::json::parse(slurp(at1 + "/manifest.json"));
  man["files"].erase(man["files"].begin() + 1);
  std::ofstream(at1 + "/manifest.json") << man.dump(1);
  auto partial = run(train({"--resume", at1}));
  CHECK(partial.exit_code == 2);
  CHECK_THAT(partial.output, Catch::Contains("its shards leave part of tensor"));
  CHECK(std::count(partial.output.begin(), partial.output.end(), '\n') == 1);
}
