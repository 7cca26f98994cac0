// Sharded checkpoints with the real programs: a run killed mid-way and resumed ends with weights
// bit-identical to an uninterrupted run of the same layout; a checkpoint of one layout loads into
// another; damaged checkpoints are skipped (auto) or refused (an explicit path).
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <random>
#include <regex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <xxhash.h>

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

// kArgs with the model flags in front taking precedence (the last --model wins): a second family
// through the same checkpoint machinery.
std::vector<std::string> train(const std::vector<std::string>& model, std::vector<std::string> extra) {
  extra.insert(extra.begin(), model.begin(), model.end());
  return train(extra);
}

// Llama with grouped-query attention and an untied head, 4 layers.
const std::vector<std::string> kLlama = {"--arch", "llama", "--model", "llama-tiny"};

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

void killed_run_resumes_bit_identically(const std::vector<std::string>& model) {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train(model, {"--save", dir.path() + "/straight.safetensors"})).ok());
  auto killed = kill_when(train(model, {"--checkpoint-dir", ck, "--checkpoint-every", "4", "--save", dir.path() + "/r.safetensors"}),
                          "step 14/24");
  CHECK(killed.signal == SIGKILL);
  CHECK_FALSE(exists(dir.path() + "/r.safetensors"));
  auto resumed = run(train(model, {"--checkpoint-dir", ck, "--checkpoint-every", "4", "--save", dir.path() + "/r.safetensors"}));
  INFO(resumed.describe());
  REQUIRE(resumed.ok());
  CHECK_THAT(resumed.output, Catch::Contains("resumed from " + ck + "/step-000000"));
  CHECK(slurp(dir.path() + "/straight.safetensors") == slurp(dir.path() + "/r.safetensors"));
  // --keep-checkpoints 3 (the default): the newest three are kept.
  CHECK(exists(ck + "/step-00000024/manifest.json"));
  CHECK(exists(ck + "/step-00000016/manifest.json"));
  CHECK_FALSE(exists(ck + "/step-00000004"));
}

TEST_CASE("a run killed mid-way resumes from its checkpoint to bit-identical weights") {
  killed_run_resumes_bit_identically({});
}

TEST_CASE("a killed Llama run resumes from its checkpoint to bit-identical weights") {
  killed_run_resumes_bit_identically(kLlama);
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

void checkpoint_reshards(const std::vector<std::string>& model) {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  REQUIRE(run(train(model, {"--save", dir.path() + "/straight.safetensors", "--metrics-jsonl", dir.path() + "/straight.jsonl"})).ok());
  auto prog = train(model, {"--tp", "2", "--pp", "2", "--micro-batches", "4", "--checkpoint-dir", ck, "--checkpoint-every", "12"});
  auto r = run(trnrun(4, prog));
  INFO(r.describe());
  REQUIRE(r.ok());
  const std::string at12 = ck + "/step-00000012";
  auto one = run(train(model, {"--resume", at12, "--save", dir.path() + "/one.safetensors", "--metrics-jsonl",
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
  auto dp = run(trnrun(2, train(model, {"--dp", "2", "--resume", at12, "--save", dir.path() + "/dp.safetensors"})));
  INFO(dp.describe());
  REQUIRE(dp.ok());
  CHECK(max_abs_diff(dir.path() + "/straight.safetensors", dir.path() + "/dp.safetensors") <= 1e-5);
}

TEST_CASE("a checkpoint of tp 2 x pp 2 loads into one process and into dp 2, matching the uninterrupted run") {
  checkpoint_reshards({});
}

TEST_CASE("a Llama checkpoint of tp 2 x pp 2 reshards into one process and into dp 2") { checkpoint_reshards(kLlama); }

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

TEST_CASE("trnrun restarts a killed ZeRO-3 worker from its sharded checkpoint, bit-identical to an uninterrupted run") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  ::mkdir(ck.c_str(), 0755);
  const std::vector<std::string> zero = {"--dp", "2", "--zero", "3"};
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
  CHECK_THAT(slurp(last + "/manifest.json"), Catch::Contains("\"zero\": 3"));
}

TEST_CASE("a ZeRO-3 dp 4 checkpoint resumes at --zero 0 --tp 2 and a --tp 2 one at ZeRO-3 dp 4, to rounding") {
  TempDir dir;
  const std::string ck3 = dir.path() + "/ck3", ckt = dir.path() + "/ckt";
  for (const auto& d : {ck3, ckt}) ::mkdir(d.c_str(), 0755);
  auto job = [&](int n, std::vector<std::string> extra) {
    auto r = run(trnrun(n, train(std::move(extra))));
    INFO(r.describe());
    REQUIRE(r.ok());
    return r;
  };
  const std::vector<std::string> z3 = {"--dp", "4", "--zero", "3"}, tp2 = {"--tp", "2", "--zero", "0"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  job(4, with(z3, {"--checkpoint-dir", ck3, "--checkpoint-every", "12", "--save", dir.path() + "/s3.safetensors",
                   "--metrics-jsonl", dir.path() + "/s3.jsonl"}));
  job(2, with(tp2, {"--checkpoint-dir", ckt, "--checkpoint-every", "12", "--save", dir.path() + "/st.safetensors",
                    "--metrics-jsonl", dir.path() + "/st.jsonl"}));
  CHECK_THAT(slurp(ck3 + "/step-00000012/manifest.json"), Catch::Contains("\"zero\": 3"));
  // Each resumed run continues the other layout's run: its steps 13..24 are that run's, to the
  // rounding of another summation order.
  const std::string from3 = ck3 + "/step-00000012", fromt = ckt + "/step-00000012";
  auto into_tp = job(2, with(tp2, {"--resume", from3, "--save", dir.path() + "/3tot.safetensors", "--metrics-jsonl",
                                   dir.path() + "/3tot.jsonl"}));
  CHECK_THAT(into_tp.output, Catch::Contains("resumed from " + from3 + " at step 12"));
  auto into_z3 = job(4, with(z3, {"--resume", fromt, "--save", dir.path() + "/tto3.safetensors", "--metrics-jsonl",
                                  dir.path() + "/tto3.jsonl"}));
  CHECK_THAT(into_z3.output, Catch::Contains("resumed from " + fromt + " at step 12"));
  CHECK(max_abs_diff(dir.path() + "/s3.safetensors", dir.path() + "/3tot.safetensors") <= 1e-5);
  CHECK(max_abs_diff(dir.path() + "/st.safetensors", dir.path() + "/tto3.safetensors") <= 1e-5);
  for (const auto& [straight, resumed] : {std::pair{"s3", "3tot"}, std::pair{"st", "tto3"}}) {
    const auto s = jsonl_losses(dir.path() + "/" + straight + ".jsonl"),
               r = jsonl_losses(dir.path() + "/" + resumed + ".jsonl");
    REQUIRE(s.size() == 24);
    REQUIRE(r.size() == 12);
    for (size_t i = 0; i < 12; ++i) CHECK(std::abs(r[i] - s[12 + i]) <= 1e-5 * s[12 + i]);
  }
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

namespace {

// A shard file's header (the JSON after its 8-byte length) and its data.
struct Shard {
  nlohmann::json header;
  std::string data;
};

Shard read_shard(const std::string& path) {
  const std::string bytes = slurp(path);
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(bytes[i]);
  return {nlohmann::json::parse(bytes.substr(8, len)), bytes.substr(8 + len)};
}

std::string shard_bytes(const Shard& s) {
  const std::string h = s.header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = char((uint64_t(h.size()) >> (8 * i)) & 0xff);
  return out + h + s.data;
}

// Writes `bytes` as the step directory's shard `name` and updates its manifest's size and hash to
// match, so only deeper checks can tell.
void replace_shard(const std::string& step, const std::string& name, const std::string& bytes) {
  std::ofstream(step + "/" + name, std::ios::binary | std::ios::trunc) << bytes;
  auto man = nlohmann::json::parse(slurp(step + "/manifest.json"));
  for (auto& f : man["files"])
    if (f["name"] == name) {
      f["bytes"] = bytes.size();
      f["xxh64"] = XXH64(bytes.data(), bytes.size(), 0);
    }
  std::ofstream(step + "/manifest.json", std::ios::trunc) << man.dump(1);
}

size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

}  // namespace

TEST_CASE("crafted manifests and shards are damaged checkpoints: verify fails, auto takes the previous one, an explicit path is one line") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  REQUIRE(run(train({"--steps", "8", "--checkpoint-dir", ck, "--checkpoint-every", "4"})).ok());
  const std::string s8 = ck + "/step-00000008", shard = s8 + "/rank-00000.shard";
  const std::string good_manifest = slurp(s8 + "/manifest.json"), good_shard = slurp(shard);
  const auto man = nlohmann::json::parse(good_manifest);
  // name -> how step 8 is damaged (its files restored before each).
  std::vector<std::pair<std::string, std::function<void()>>> cases;
  auto manifest_case = [&](const std::string& name, std::function<void(nlohmann::json&)> edit) {
    cases.emplace_back(name, [&, edit] {
      nlohmann::json m = man;
      edit(m);
      std::ofstream(s8 + "/manifest.json", std::ios::trunc) << m.dump(1);
    });
  };
  manifest_case("no files", [](auto& m) { m.erase("files"); });
  manifest_case("bytes a string", [](auto& m) { m["files"][0]["bytes"] = "10"; });
  manifest_case("version a string", [](auto& m) { m["version"] = "3"; });
  manifest_case("files an object", [](auto& m) { m["files"] = nlohmann::json::object(); });
  manifest_case("manifest an array", [](auto& m) { m = nlohmann::json::array({m}); });
  manifest_case("no layout", [](auto& m) { m.erase("layout"); });
  manifest_case("no step", [](auto& m) { m.erase("step"); });
  manifest_case("step -5", [](auto& m) { m["step"] = -5; });
  manifest_case("step 2^62", [](auto& m) { m["step"] = int64_t(1) << 62; });
  manifest_case("files empty", [](auto& m) { m["files"] = nlohmann::json::array(); });
  manifest_case("a path as shard name", [](auto& m) { m["files"][0]["name"] = "../step-00000004/rank-00000.shard"; });
  auto shard_case = [&](const std::string& name, std::function<void(Shard&)> edit) {
    cases.emplace_back(name, [&, edit] {
      Shard s = read_shard(shard);
      edit(s);
      replace_shard(s8, "rank-00000.shard", shard_bytes(s));
    });
  };
  auto entry = [](Shard& s, const std::string& name) -> nlohmann::json& {
    for (auto& t : s.header["tensors"])
      if (t["name"] == name) return t;
    throw std::runtime_error("no tensor " + name);
  };
  // Split along dimension 1 at an offset far outside the tensor (same element count).
  shard_case("slice offset out of range", [&](Shard& s) {
    auto& t = entry(s, "h.0.attn.c_attn.weight");
    t["dim"] = 1;
    t["offset"] = 1000000;
    t["length"] = t["global_shape"][1];
  });
  shard_case("data offset past the file", [&](Shard& s) { entry(s, "h.1.mlp.c_fc.weight")["data_offset"] = 1u << 30; });
  shard_case("numel missing", [&](Shard& s) { entry(s, "wpe.weight").erase("numel"); });
  shard_case("interleave 0", [&](Shard& s) { entry(s, "h.0.ln_1.bias")["interleave"] = 0; });
  shard_case("a tensor's bytes changed", [&](Shard& s) { s.data[s.data.size() / 2] ^= 0x10; });
  cases.emplace_back("random bytes", [&] {
    std::mt19937 rng(7);
    std::string junk(good_shard.size(), '\0');
    for (char& c : junk) c = char(rng());
    replace_shard(s8, "rank-00000.shard", junk);
  });
  for (const auto& [name, damage] : cases) {
    INFO("case: " << name);
    std::ofstream(s8 + "/manifest.json", std::ios::trunc) << good_manifest;
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << good_shard;
    damage();
    auto verify = run({bin("trn-ckpt"), "verify", s8});
    INFO(verify.describe());
    CHECK(verify.exit_code == 1);
    CHECK_THAT(verify.output, !Catch::Contains("internal error"));
    auto bad = run(train({"--steps", "8", "--resume", s8}));
    INFO(bad.describe());
    CHECK(bad.exit_code == 2);
    CHECK(lines(bad.output) == 1);
    CHECK_THAT(bad.output, Catch::Contains("checkpoint") && !Catch::Contains("internal error"));
    auto fallback = run(train({"--steps", "8", "--checkpoint-dir", ck}));
    INFO(fallback.describe());
    CHECK(fallback.ok());
    CHECK_THAT(fallback.output, Catch::Contains("skipping checkpoint " + s8));
    CHECK_THAT(fallback.output, Catch::Contains("resumed from " + ck + "/step-00000004 at step 4"));
  }
  // The messages name the file and the field.
  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good_shard;
  nlohmann::json m = man;
  m["files"][0]["bytes"] = "10";
  std::ofstream(s8 + "/manifest.json", std::ios::trunc) << m.dump(1);
  CHECK_THAT(run({bin("trn-ckpt"), "verify", s8}).output,
             Catch::Contains("damaged checkpoint " + s8 + "/manifest.json: field \"files[0].bytes\""));
  m = man;
  m["step"] = -5;
  std::ofstream(s8 + "/manifest.json", std::ios::trunc) << m.dump(1);
  CHECK_THAT(run({bin("trn-ckpt"), "verify", s8}).output, Catch::Contains("field \"step\""));
}

TEST_CASE("a restart resumes its own run's newest checkpoint, never a newer one of another run") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck", other = dir.path() + "/other";
  // Another run's committed checkpoint at step 30 of the same model.
  REQUIRE(run(train({"--steps", "30", "--checkpoint-dir", other})).ok());
  REQUIRE(exists(other + "/step-00000030/manifest.json"));
  // A checkpoint every 10 steps and a kill once step 12 is logged: the next commit is 8 steps
  // away, so the run's own newest checkpoint at the kill is step 10 even on a loaded machine.
  auto prog = train({"--dp", "2", "--checkpoint-dir", ck, "--checkpoint-every", "10"});
  // The run id is trnrun's own (TRN_RUN_ID, kept by its restarts), as a user gets it.
  Process job(ProcSpec{trnrun(2, prog, {"--max-restarts", "1"}), {}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  bool copied = false;
  std::string out, run_id;
  for (;; std::this_thread::sleep_for(5ms)) {
    REQUIRE(std::chrono::steady_clock::now() < until);
    out = job.output_so_far();
    if (!copied && out.find("checkpoint of step 10 committed") != std::string::npos) {
      // The foreign checkpoint appears while the job runs.
      run_id = nlohmann::json::parse(slurp(ck + "/step-00000010/manifest.json")).at("run_id").get<std::string>();
      REQUIRE(run({"cp", "-r", other + "/step-00000030", ck + "/"}).ok());
      copied = true;
    }
    if (copied && out.find("step 12/24") != std::string::npos) break;
  }
  std::smatch m;
  REQUIRE(std::regex_search(out, m, std::regex("\\[rank 1\\] [^\\n]*\\[[^:\\]]+:([0-9]+) r1 g0")));
  ::kill(std::stoi(m[1]), SIGKILL);
  auto r = job.wait(std::chrono::steady_clock::now() + 300s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("restarting the workers in a new generation"));
  CHECK_THAT(r.output, Catch::Contains("resumed from " + ck + "/step-00000010 at step 10"));
  CHECK_THAT(r.output, Catch::Contains("step 24/24"));
  CHECK(nlohmann::json::parse(slurp(ck + "/step-00000024/manifest.json")).at("run_id") == run_id);
  CHECK(nlohmann::json::parse(slurp(ck + "/step-00000030/manifest.json")).at("run_id") != run_id);
}

TEST_CASE("resume never refuses a directory holding committed checkpoints; checkpoints without a run id still load") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  REQUIRE(run(train({"--steps", "8", "--checkpoint-dir", ck, "--checkpoint-every", "4"})).ok());
  auto never = run(train({"--steps", "8", "--checkpoint-dir", ck, "--resume", "never"}));
  INFO(never.describe());
  CHECK(never.exit_code == 2);
  CHECK(lines(never.output) == 1);
  CHECK_THAT(never.output, Catch::Contains(ck + "/step-00000008") && Catch::Contains("--resume auto to continue it"));
  CHECK(exists(ck + "/step-00000004/manifest.json"));  // nothing moved or deleted
  CHECK(exists(ck + "/step-00000008/manifest.json"));
  // A checkpoint of the format before run ids (manifest version 1, no run_id or settings).
  auto man = nlohmann::json::parse(slurp(ck + "/step-00000008/manifest.json"));
  man["version"] = 1;
  man.erase("run_id");
  man.erase("settings");
  std::ofstream(ck + "/step-00000008/manifest.json", std::ios::trunc) << man.dump(1);
  CHECK(run({bin("trn-ckpt"), "verify", ck + "/step-00000008"}).exit_code == 0);
  auto old = run(train({"--steps", "12", "--checkpoint-dir", ck, "--allow-changed-settings"}));
  INFO(old.describe());
  CHECK(old.ok());
  CHECK_THAT(old.output, Catch::Contains("resumed from " + ck + "/step-00000008 at step 8"));
}

TEST_CASE("resuming with other training settings is one line naming them unless --allow-changed-settings") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck", s12 = ck + "/step-00000012";
  REQUIRE(run(train({"--steps", "12", "--checkpoint-dir", ck})).ok());
  struct Change {
    std::vector<std::string> flags;
    std::string was, now;
  };
  for (const Change& c : std::vector<Change>{{{"--lr", "2e-4"}, "--lr 0.0001", "--lr 0.0002"},
                                             {{"--batch-size", "16"}, "--batch-size 8", "--batch-size 16"},
                                             {{"--seq-len", "16"}, "--seq-len 32", "--seq-len 16"},
                                             {{"--steps", "20"}, "--steps 12", "--steps 20"},
                                             {{"--lr-schedule", "constant"}, "--lr-schedule cosine", "--lr-schedule constant"},
                                             {{"--warmup-steps", "2"}, "--warmup-steps 0", "--warmup-steps 2"},
                                             {{"--weight-decay", "0"}, "--weight-decay 0.1", "--weight-decay 0"},
                                             {{"--beta2", "0.99"}, "--beta2 0.95", "--beta2 0.99"},
                                             {{"--grad-clip", "0.5"}, "--grad-clip 1", "--grad-clip 0.5"},
                                             {{"--seed", "7"}, "--seed 1337", "--seed 7"}}) {
    std::vector<std::string> args = {"--steps", "12"};
    args.insert(args.end(), c.flags.begin(), c.flags.end());
    args.insert(args.end(), {"--resume", s12});
    auto r = run(train(args));
    INFO(r.describe());
    CHECK(r.exit_code == 2);
    CHECK(lines(r.output) == 1);
    CHECK_THAT(r.output, Catch::Contains("saved with " + c.was) && Catch::Contains("this run has " + c.now) &&
                             Catch::Contains("--allow-changed-settings"));
  }
  // Where it already is: one line, exit 0, nothing trained.
  auto done = run(train({"--steps", "12", "--checkpoint-dir", ck}));
  INFO(done.describe());
  CHECK(done.ok());
  CHECK_THAT(done.output, Catch::Contains("training is already complete"));
  CHECK_THAT(done.output, !Catch::Contains("step 12/12"));
  // Allowed: one warning per changed setting, then training goes on to the new --steps.
  auto more = run(train({"--steps", "16", "--lr", "2e-4", "--checkpoint-dir", ck, "--allow-changed-settings"}));
  INFO(more.describe());
  CHECK(more.ok());
  CHECK_THAT(more.output, Catch::Contains("with --steps 16 (it was saved with --steps 12)"));
  CHECK_THAT(more.output, Catch::Contains("with --lr 0.0002 (it was saved with --lr 0.0001)"));
  CHECK_THAT(more.output, Catch::Contains("step 16/16"));
  // Past --steps: an error (it names --steps), unless allowed (then nothing to do).
  auto past = run(train({"--steps", "12", "--resume", ck + "/step-00000016", "--lr", "2e-4"}));
  CHECK(past.exit_code == 2);
  CHECK_THAT(past.output, Catch::Contains("--steps 16") && Catch::Contains("--steps 12"));
  auto past_ok = run(train({"--steps", "12", "--resume", ck + "/step-00000016", "--lr", "2e-4", "--allow-changed-settings"}));
  CHECK(past_ok.ok());
  CHECK_THAT(past_ok.output, Catch::Contains("training is already complete"));
}

TEST_CASE("one --checkpoint-dir, two jobs: the second refuses at once naming the holder") {
  TempDir dir;
  const std::string ck = dir.path() + "/ck";
  Process first(ProcSpec{train({"--steps", "100000", "--checkpoint-dir", ck, "--checkpoint-every", "1000"}), {}});
  const auto until = std::chrono::steady_clock::now() + 60s;
  while (first.output_so_far().find("step 1/") == std::string::npos) {
    REQUIRE(std::chrono::steady_clock::now() < until);
    std::this_thread::sleep_for(5ms);
  }
  auto second = run(train({"--steps", "8", "--checkpoint-dir", ck, "--checkpoint-every", "4"}));
  INFO(second.describe());
  CHECK(second.exit_code == 2);
  CHECK(lines(second.output) == 1);
  CHECK_THAT(second.output, Catch::Contains("in use by another job") &&
                                Catch::Contains(fmt::format("pid {} run ", first.pid())));
  CHECK_FALSE(exists(ck + "/step-00000004"));
  first.signal(SIGKILL);
  first.wait(std::chrono::steady_clock::now() + 30s);
  // The holder is dead: the lock is free again.
  auto third = run(train({"--steps", "4", "--checkpoint-dir", ck}));
  INFO(third.describe());
  CHECK(third.ok());
}

TEST_CASE("a missing checkpoint directory is created with its parents; one that cannot be is one line") {
  TempDir dir;
  const std::string ck = dir.path() + "/new/nested/ck";
  auto r = run(train({"--steps", "4", "--checkpoint-dir", ck}));
  INFO(r.describe());
  CHECK(r.ok());
  CHECK(exists(ck + "/step-00000004/manifest.json"));
  std::ofstream(dir.path() + "/file") << "x";
  auto bad = run(train({"--steps", "4", "--checkpoint-dir", dir.path() + "/file/ck"}));
  INFO(bad.describe());
  CHECK(bad.exit_code == 2);
  CHECK(lines(bad.output) == 1);
  CHECK_THAT(bad.output, Catch::Contains("--checkpoint-dir " + dir.path() + "/file/ck"));
}
