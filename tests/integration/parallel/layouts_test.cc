// Parallel layouts end to end with the real programs: trnrun (embedded coordinator) or mpirun
// starts dp x tp trn-train workers. Whatever the layout, the per-step losses equal the
// one-process run's to 1e-5 relative over 50 steps, the saved file (gathered from the shards)
// equals the one-process file to 1e-5, and a layout run twice is bit-identical.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <signal.h>

#include <fmt/format.h>

#include "runtime/io/safetensors.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> trnrun(int n, const std::vector<std::string>& p) { return trnrun_cmd(n, p); }
std::vector<std::string> mpirun(int n, const std::vector<std::string>& p) { return mpirun_cmd(n, p); }
std::vector<double> losses(const std::string& f) { return jsonl_losses(f); }
std::string slurp(const std::string& p) { return file_bytes(p); }

// tiny with 8 heads, so tensor parallelism of 8 divides n_head too. Layouts differ from one
// process only in rounding (the order of sums inside row-parallel matmuls, the cross-entropy and
// the gradient averaging), but AdamW divides each gradient by its own running magnitude: a weight
// whose true gradient is near zero moves by up to lr * |g| / eps per step on rounding noise
// alone, so weight differences grow with lr. This test's lr keeps them a few times below the
// 1e-5 bound for every layout (bench/results/2026-12-01-layout-equality.md).
const std::vector<std::string> kTrainArgs = {"--steps", "50", "--batch-size", "8", "--seq-len", "32",
                                             "--log-every", "25", "--bucket-mb", "0.25", "--lr", "1e-4"};
const std::vector<std::string> kGpt2 = {"--model", "tiny", "--n-head", "8"};
// Llama with grouped-query attention (16 heads sharing 8 KV heads, so tp up to 8 divides them)
// and an untied head: the same machinery must give the same equalities for a second family.
const std::vector<std::string> kLlama = {"--arch", "llama", "--model", "llama-tiny", "--n-head", "16", "--n-kv-head", "8"};

struct Layout {
  int dp, tp, pp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1, micro_batches = 1;
  std::vector<std::string> model = kGpt2;
};

std::vector<std::string> train_cmd(const std::string& dir, const std::string& name, Layout l,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> c = {bin("trn-train")};
  c.insert(c.end(), l.model.begin(), l.model.end());
  c.insert(c.end(), kTrainArgs.begin(), kTrainArgs.end());
  c.insert(c.end(), {"--metrics-jsonl", dir + "/" + name + ".jsonl", "--save", dir + "/" + name + ".safetensors",
                     "--dp", std::to_string(l.dp), "--tp", std::to_string(l.tp)});
  if (l.pp > 1)
    c.insert(c.end(), {"--pp", std::to_string(l.pp), "--schedule", l.schedule, "--virtual-stages",
                       std::to_string(l.virtual_stages)});
  if (l.micro_batches > 1) c.insert(c.end(), {"--micro-batches", std::to_string(l.micro_batches)});
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}





ProcResult run(std::vector<std::string> argv, std::map<std::string, std::string> env = {}) {
  return run_all({ProcSpec{std::move(argv), std::move(env)}}, 400s).at(0);
}

void check_losses(const std::vector<double>& one, const std::vector<double>& got) {
  REQUIRE(one.size() >= 30);
  REQUIRE(got.size() == one.size());
  double worst = 0.0;
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("step " << i + 1 << ": " << one[i] << " vs " << got[i]);
    CHECK(std::abs(one[i] - got[i]) <= 1e-5 * std::abs(one[i]));
    worst = std::max(worst, std::abs(one[i] - got[i]) / std::abs(one[i]));
  }
  WARN("largest relative loss difference " << worst);
}

// Every tensor of b equals a's to max_abs; same names and shapes.
void check_files(const std::string& a, const std::string& b, double max_abs) {
  trn::io::SafetensorsFile fa(a), fb(b);
  REQUIRE(fa.tensors().size() == fb.tensors().size());
  double worst = 0.0;
  for (const auto& [name, ta] : fa.tensors()) {
    auto it = fb.tensors().find(name);
    REQUIRE(it != fb.tensors().end());
    const auto& tb = it->second;
    REQUIRE(ta.shape == tb.shape);
    REQUIRE(ta.end - ta.begin == tb.end - tb.begin);
    const size_t n = (ta.end - ta.begin) / sizeof(float);
    const auto* pa = reinterpret_cast<const float*>(fa.data(ta));
    const auto* pb = reinterpret_cast<const float*>(fb.data(tb));
    for (size_t i = 0; i < n; ++i) worst = std::max(worst, double(std::abs(pa[i] - pb[i])));
  }
  INFO("largest weight difference " << worst);
  CHECK(worst <= max_abs);
}

struct OneProcess {
  std::vector<double> losses;
  std::string file;
};

// One process on l's model and kTrainArgs plus `model`: the reference each layout must equal.
const OneProcess& one_process_with(const Layout& l, const std::vector<std::string>& model) {
  static TempDir dir;  // lives for the whole test run: one reference per model
  static std::map<std::vector<std::string>, OneProcess> cache;
  std::vector<std::string> key = l.model;
  key.insert(key.end(), model.begin(), model.end());
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  const std::string name = "one" + std::to_string(cache.size());
  Layout one{1, 1};
  one.model = l.model;
  auto r = run(train_cmd(dir.path(), name, one, model));
  INFO(r.describe());
  REQUIRE(r.ok());
  return cache[key] = {losses(dir.path() + "/" + name + ".jsonl"), dir.path() + "/" + name + ".safetensors"};
}

void check_layout(const std::string& launcher, Layout l) {
  TempDir dir;
  const OneProcess& one = one_process_with(l, {});
  const int n = l.dp * l.tp;
  const auto prog = train_cmd(dir.path(), "run", l);
  auto r = launcher == "mpirun" ? run(mpirun(n, prog), {{"OMPI_MCA_btl", "self,tcp"}}) : run(trnrun(n, prog));
  INFO(launcher << " dp " << l.dp << " tp " << l.tp << ": " << r.describe());
  REQUIRE(r.ok());
  if (l.tp > 1) CHECK_THAT(r.output, Catch::Contains(fmt::format("identical on all {} tensor-parallel ranks", l.tp)));
  if (l.dp > 1) CHECK_THAT(r.output, Catch::Contains(fmt::format("identical on all {} data-parallel replicas", l.dp)));
  check_losses(one.losses, losses(dir.path() + "/run.jsonl"));
  check_files(one.file, dir.path() + "/run.safetensors", 1e-5);
}

// Pipeline layouts: tiny with 4 layers (8 when the virtual stages need them), 30 steps.
std::vector<std::string> pipeline_model(const Layout& l) {
  const int layers = std::max(4, l.pp * l.virtual_stages);
  return {"--n-layer", std::to_string(layers), "--steps", "30"};
}


// A layout run twice: the same losses and the same saved file, bit for bit.
void check_repeat(const Layout& l, const std::vector<std::string>& model, size_t steps) {
  TempDir dir;
  for (const char* name : {"a", "b"}) {
    auto r = run(trnrun(l.dp * l.tp * l.pp, train_cmd(dir.path(), name, l, model)));
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  const auto a = losses(dir.path() + "/a.jsonl"), b = losses(dir.path() + "/b.jsonl");
  REQUIRE(a.size() == steps);
  CHECK(a == b);
  CHECK(slurp(dir.path() + "/a.safetensors") == slurp(dir.path() + "/b.safetensors"));
}

void check_pipeline(const std::string& launcher, const Layout& l) {
  const auto model = pipeline_model(l);
  const OneProcess& one = one_process_with(l, model);
  TempDir dir;
  const int n = l.dp * l.tp * l.pp;
  const auto prog = train_cmd(dir.path(), "run", l, model);
  auto r = launcher == "mpirun" ? run(mpirun(n, prog), {{"OMPI_MCA_btl", "self,tcp"}}) : run(trnrun(n, prog));
  INFO(launcher << " dp " << l.dp << " tp " << l.tp << " pp " << l.pp << " " << l.schedule << " V " << l.virtual_stages
                << " M " << l.micro_batches << ": " << r.describe());
  REQUIRE(r.ok());
  if (l.model == kGpt2) CHECK_THAT(r.output, Catch::Contains("identical on all 2 copies of the tied wte"));
  CHECK_THAT(r.output, Catch::Contains("pipeline: " + l.schedule));
  check_losses(one.losses, losses(dir.path() + "/run.jsonl"));
  check_files(one.file, dir.path() + "/run.safetensors", 1e-5);
}

}  // namespace

TEST_CASE("trnrun: tensor parallelism of 2 equals one process") { check_layout("trnrun", {1, 2}); }

TEST_CASE("trnrun: dp 2 x tp 2 equals one process") { check_layout("trnrun", {2, 2}); }

TEST_CASE("mpirun: dp 2 x tp 2 equals one process", "[mpi]") { check_layout("mpirun", {2, 2}); }

// Under trnrun every dp x tp layout (pp 1) runs in the Llama matrix below, GPT-2's tp 2 and
// dp 2 x tp 2 in the tests above, and every pipeline layout in the matrices: a launcher only
// numbers the ranks and bootstraps them, so this matrix takes every dp x tp layout of GPT-2
// through the other launcher.
TEST_CASE("mpirun: every dp x tp layout of 2, 4 and 8 workers equals one process", "[slow][mpi]") {
  const Layout layouts[] = {{2, 1}, {1, 2}, {4, 1}, {2, 2}, {1, 4}, {8, 1}, {4, 2}, {2, 4}, {1, 8}};
  for (Layout l : layouts) {
    DYNAMIC_SECTION("dp " << l.dp << " tp " << l.tp) { check_layout("mpirun", l); }
  }
}

TEST_CASE("trnrun: pipeline of 2 stages (1F1B) equals one process") { check_pipeline("trnrun", {1, 1, 2, "1f1b", 1, 4}); }

TEST_CASE("trnrun: dp 2 x tp 2 x pp 2 equals one process") { check_pipeline("trnrun", {2, 2, 2, "1f1b", 1, 2}); }

TEST_CASE("trnrun: interleaved pipeline of 2 stages x 2 chunks equals one process") {
  check_pipeline("trnrun", {1, 1, 2, "interleaved", 2, 4});
}

TEST_CASE("trnrun: tp 2 x pp 2 under GPipe equals one process") { check_pipeline("trnrun", {1, 2, 2, "gpipe", 1, 4}); }

TEST_CASE("mpirun: tp 2 x pp 2 equals one process", "[mpi]") { check_pipeline("mpirun", {1, 2, 2, "1f1b", 1, 4}); }

TEST_CASE("every dp x tp x pp layout of 2, 4 and 8 workers under every schedule equals one process", "[slow]") {
  for (int dp : {1, 2, 4})
    for (int tp : {1, 2, 4})
      for (int pp : {2, 4, 8}) {
        const int n = dp * tp * pp;
        if (n != 2 && n != 4 && n != 8) continue;
        const int per_rank = 8 / dp;  // sequences of the global batch of 8 on each replica
        for (const char* schedule : {"gpipe", "1f1b", "interleaved", "zb"}) {
          const bool interleaved = std::string(schedule) == "interleaved";
          const int M = interleaved ? pp : std::min(per_rank, 4);
          if (M > per_rank || per_rank % M != 0) continue;
          if (interleaved && pp * 2 > 8) continue;  // 2 chunks per rank need 2 pp layers
          Layout l{dp, tp, pp, schedule, interleaved ? 2 : 1, M};
          DYNAMIC_SECTION("dp " << dp << " tp " << tp << " pp " << pp << " " << schedule) { check_pipeline("trnrun", l); }
        }
      }
}

Layout llama(Layout l) {
  l.model = kLlama;
  return l;
}

TEST_CASE("Llama: tp 2 with grouped-query attention equals one process") { check_layout("trnrun", llama({1, 2})); }

TEST_CASE("Llama: dp 2 x tp 2 x pp 2 equals one process") { check_pipeline("trnrun", llama({2, 2, 2, "1f1b", 1, 2})); }

TEST_CASE("Llama: a zero-bubble pipeline with a tied head equals one process") {
  Layout l = llama({1, 1, 2, "zb", 1, 4});
  l.model.insert(l.model.end(), {"--tie-embeddings", "1"});
  check_pipeline("trnrun", l);
}

TEST_CASE("Llama: every dp x tp x pp layout of 2, 4 and 8 workers equals one process", "[slow]") {
  for (int dp : {1, 2, 4, 8})
    for (int tp : {1, 2, 4, 8})
      for (int pp : {1, 2, 4, 8}) {
        const int n = dp * tp * pp;
        if (n != 2 && n != 4 && n != 8) continue;
        const int per_rank = 8 / dp;
        // The pipeline schedules take turns, so the matrix covers each of them too.
        const char* schedules[] = {"1f1b", "zb", "gpipe", "interleaved"};
        const char* schedule = schedules[(dp + tp + pp) % 4];
        const bool interleaved = std::string(schedule) == "interleaved" && pp * 2 <= 8 && per_rank % pp == 0;
        if (!interleaved && std::string(schedule) == "interleaved") schedule = "1f1b";
        const int M = interleaved ? pp : std::min(per_rank, 4);
        DYNAMIC_SECTION("dp " << dp << " tp " << tp << " pp " << pp << " " << (pp > 1 ? schedule : "")) {
          if (pp == 1) check_layout("trnrun", llama({dp, tp}));
          else check_pipeline("trnrun", llama({dp, tp, pp, schedule, interleaved ? 2 : 1, M}));
        }
      }
}

TEST_CASE("the zero-bubble schedule gives 1F1B's weights bit for bit, and equals one process") {
  check_pipeline("trnrun", {1, 1, 2, "zb", 1, 4});
  TempDir dir;
  for (const char* schedule : {"1f1b", "zb"}) {
    const Layout l{1, 1, 2, schedule, 1, 4};
    auto r = run(trnrun(2, train_cmd(dir.path(), schedule, l, pipeline_model(l))));
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  // W adds each micro-batch's weight gradients in the order a full backward does.
  CHECK(losses(dir.path() + "/1f1b.jsonl") == losses(dir.path() + "/zb.jsonl"));
  CHECK(slurp(dir.path() + "/1f1b.safetensors") == slurp(dir.path() + "/zb.safetensors"));
}

TEST_CASE("a pipeline layout run twice is bit-identical") {
  const Layout l{1, 2, 2, "interleaved", 2, 2};
  check_repeat(l, pipeline_model(l), 30);
}

TEST_CASE("a pipeline layout the model or the schedule cannot take is one line and exit 2") {
  TempDir dir;
  auto layers = run(train_cmd(dir.path(), "x", {1, 1, 2, "1f1b", 1, 2}, {"--n-layer", "3"}));
  CHECK(layers.exit_code == 2);
  CHECK_THAT(layers.output, Catch::Contains("2 virtual stages do not divide n_layer 3"));
  auto chunks = run(train_cmd(dir.path(), "x", {1, 1, 2, "interleaved", 2, 2}, {"--n-layer", "6"}));
  CHECK(chunks.exit_code == 2);
  CHECK_THAT(chunks.output, Catch::Contains("4 virtual stages do not divide n_layer 6"));
  auto mbs = run(train_cmd(dir.path(), "x", {1, 1, 2, "interleaved", 2, 1}, {"--n-layer", "4"}));
  CHECK(mbs.exit_code == 2);
  CHECK_THAT(mbs.output, Catch::Contains("needs --micro-batches a multiple of --pp 2"));
  auto virt = run(train_cmd(dir.path(), "x", {1, 1, 2, "1f1b", 2, 2}, {"--n-layer", "4"}));
  CHECK(virt.exit_code == 2);
  CHECK_THAT(virt.output, Catch::Contains("--virtual-stages 2 needs --schedule interleaved"));
  auto sched = run(train_cmd(dir.path(), "x", {1, 1, 2, "zigzag", 1, 2}, {"--n-layer", "4"}));
  CHECK(sched.exit_code == 2);
  CHECK_THAT(sched.output, Catch::Contains("gpipe, 1f1b, interleaved or zb"));
  for (const auto* r : {&layers, &chunks, &mbs, &virt, &sched})
    CHECK(std::count(r->output.begin(), r->output.end(), '\n') == 1);
}

TEST_CASE("a layout run twice is bit-identical") { check_repeat({2, 2}, {}, 50); }

TEST_CASE("a vocabulary that tp does not divide is padded, and the padding never shows") {
  // vocab 259 over tp 2: 260 rows, one of them padding. It must not change the loss, and the
  // saved wte has the model's 259 rows.
  TempDir dir;
  auto one = run(train_cmd(dir.path(), "one", {1, 1}, {"--vocab", "259", "--steps", "20"}));
  INFO(one.describe());
  REQUIRE(one.ok());
  auto r = run(trnrun(2, train_cmd(dir.path(), "tp", {1, 2}, {"--vocab", "259", "--steps", "20"})));
  INFO(r.describe());
  REQUIRE(r.ok());
  const auto a = losses(dir.path() + "/one.jsonl"), b = losses(dir.path() + "/tp.jsonl");
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == 20);
  for (size_t i = 0; i < a.size(); ++i) CHECK(std::abs(a[i] - b[i]) <= 1e-5 * a[i]);
  trn::io::SafetensorsFile f(dir.path() + "/tp.safetensors");
  CHECK(f.tensors().at("wte.weight").shape == std::vector<int64_t>{259, 128});
  check_files(dir.path() + "/one.safetensors", dir.path() + "/tp.safetensors", 1e-5);
}

TEST_CASE("an --init file loads into every layout's shards") {
  TempDir dir;
  auto base = run(train_cmd(dir.path(), "base", {1, 1}, {"--steps", "5"}));
  REQUIRE(base.ok());
  const std::string init = dir.path() + "/base.safetensors";
  auto one = run(train_cmd(dir.path(), "one", {1, 1}, {"--steps", "10", "--init", init}));
  REQUIRE(one.ok());
  auto r = run(trnrun(4, train_cmd(dir.path(), "tp", {1, 4}, {"--steps", "10", "--init", init})));
  INFO(r.describe());
  REQUIRE(r.ok());
  const auto a = losses(dir.path() + "/one.jsonl"), b = losses(dir.path() + "/tp.jsonl");
  REQUIRE(a.size() == 10);
  REQUIRE(b.size() == 10);
  for (size_t i = 0; i < a.size(); ++i) CHECK(std::abs(a[i] - b[i]) <= 1e-5 * a[i]);
  check_files(dir.path() + "/one.safetensors", dir.path() + "/tp.safetensors", 1e-5);
}

TEST_CASE("a tensor-parallel layout the model or the job cannot take is one line and exit 2") {
  TempDir dir;
  // --tp 3 does not divide 8 heads.
  auto r = run(trnrun(3, train_cmd(dir.path(), "x", {1, 3})));
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("--tp 3 does not divide n_head 8"));
  CHECK_THAT(r.output, Catch::Contains("use --tp one of 1, 2, 4, 8"));
  // --tp 2 in one process.
  auto alone = run(train_cmd(dir.path(), "y", {1, 2}));
  CHECK(alone.exit_code == 2);
  CHECK_THAT(alone.output, Catch::Contains("--dp 1 --tp 2 --pp 1 needs 2 workers but the job has 1"));
  CHECK_THAT(alone.output, Catch::Contains("use --dp 1 --tp 1 --pp 1"));
  // dp x tp x pp not the world size.
  auto wrong = run(trnrun(2, train_cmd(dir.path(), "z", {2, 2})));
  CHECK_FALSE(wrong.ok());
  CHECK_THAT(wrong.output, Catch::Contains("--dp 2 --tp 2 --pp 1 needs 4 workers but the job has 2"));
  CHECK_THAT(wrong.output, Catch::Contains("use --dp 1 --tp 2 --pp 1"));
}

TEST_CASE("trnctl status shows each rank's grid coordinates") {
  TempDir dir;
  auto prog = train_cmd(dir.path(), "long", {2, 2}, {"--steps", "100000", "--log-every", "1"});
  Process job(ProcSpec{trnrun(4, prog), {{"TRN_HEARTBEAT_INTERVAL", "0.2"}}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  std::smatch m;
  std::string address;
  std::regex at("embedded coordinator \\(pid [0-9]+\\) at ([0-9.]+:[0-9]+)");
  while (std::chrono::steady_clock::now() < until) {
    const std::string& out = job.output_so_far();
    if (address.empty() && std::regex_search(out, m, at)) address = m[1];
    if (!address.empty() && out.find("step 3/") != std::string::npos) break;
    std::this_thread::sleep_for(50ms);
  }
  REQUIRE(!address.empty());
  std::string json;
  for (int attempt = 0; attempt < 50; ++attempt) {  // until every rank's heartbeat carried them
    auto st = run({bin("trnctl"), "--coordinator", address, "status", "--json"});
    json = st.output;
    if (json.find("\"coordinates\": null") == std::string::npos && json.find("\"tp\": 1") != std::string::npos) break;
    std::this_thread::sleep_for(200ms);
  }
  job.signal_group(SIGTERM);
  job.wait(std::chrono::steady_clock::now() + 60s);
  INFO(json);
  for (const char* c : {"{\"dp\": 0, \"tp\": 0, \"pp\": 0}", "{\"dp\": 0, \"tp\": 1, \"pp\": 0}",
                        "{\"dp\": 1, \"tp\": 0, \"pp\": 0}", "{\"dp\": 1, \"tp\": 1, \"pp\": 0}"})
    CHECK_THAT(json, Catch::Contains(c));
}

// One event per line: whether a line holds every part.
bool has_event(const std::string& trace, const std::vector<std::string>& parts) {
  std::istringstream in(trace);
  for (std::string line; std::getline(in, line);) {
    bool all = true;
    for (const auto& p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return true;
  }
  return false;
}

TEST_CASE("trn-train --trace writes one Chrome trace timeline, merged by rank 0, or one file per rank") {
  TempDir dir;
  const Layout l{1, 2, 2, "1f1b", 1, 4};
  auto r = run(trnrun(4, train_cmd(dir.path(), "t", l, {"--n-layer", "4", "--steps", "2", "--trace", dir.path() + "/trace.json"})));
  INFO(r.describe());
  REQUIRE(r.ok());
  const std::string merged = slurp(dir.path() + "/trace.json");
  REQUIRE(merged.rfind("{\"traceEvents\": [", 0) == 0);
  for (int rank = 0; rank < 4; ++rank) {
    CHECK_THAT(merged, Catch::Contains(fmt::format("\"pid\":{},\"args\":{{\"name\":\"rank {}", rank, rank)));
    // every rank ran the forward and backward of micro-batch 3, and the TP all-reduces
    const std::string pid = fmt::format("\"pid\":{},", rank);
    CHECK(has_event(merged, {"\"name\":\"forward\"", "\"ph\":\"X\"", pid, "\"mb\":3"}));
    CHECK(has_event(merged, {"\"name\":\"backward\"", pid, "\"mb\":3"}));
    CHECK(has_event(merged, {"\"name\":\"tp all-reduce\"", pid}));
  }
  CHECK_THAT(merged, Catch::Contains("\"name\":\"wait: receive activations\""));
  CHECK_THAT(merged, Catch::Contains("\"name\":\"optimizer\""));
  auto per = run(trnrun(2, train_cmd(dir.path(), "p", {1, 1, 2, "zb", 1, 2},
                                     {"--n-layer", "4", "--steps", "2", "--trace", dir.path() + "/rank{rank}.json"})));
  INFO(per.describe());
  REQUIRE(per.ok());
  for (int rank = 0; rank < 2; ++rank) {
    const std::string one = slurp(dir.path() + fmt::format("/rank{}.json", rank));
    CHECK_THAT(one, Catch::Contains(fmt::format("\"name\":\"rank {} (dp 0, tp 0, pp {})\"", rank, rank)));
    CHECK_THAT(one, Catch::Contains("\"name\":\"backward (weights)\""));
  }
}

TEST_CASE("a pipeline stage killed mid-run fails the other stage naming it, and trnrun restarts the group") {
  TempDir dir;
  const Layout l{1, 1, 2, "1f1b", 1, 4};
  auto prog = train_cmd(dir.path(), "k", l, {"--n-layer", "4", "--steps", "400", "--log-every", "1"});
  std::vector<std::string> cmd = {bin("trnrun"), "--nproc-per-node", "2", "--max-restarts", "1", "--"};
  cmd.insert(cmd.end(), prog.begin(), prog.end());
  Process job(ProcSpec{cmd, {}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  std::smatch m;
  std::regex pid_of_rank1("\\[rank 1\\] [^\\n]*\\[[a-zA-Z0-9_.-]+:([0-9]+) r1 g0");
  std::string pid;
  while (std::chrono::steady_clock::now() < until) {
    const std::string& out = job.output_so_far();
    if (pid.empty() && std::regex_search(out, m, pid_of_rank1)) pid = m[1];
    if (!pid.empty() && out.find("step 20/400") != std::string::npos) break;
    std::this_thread::sleep_for(20ms);
  }
  REQUIRE(!pid.empty());
  ::kill(std::stoi(pid), SIGKILL);
  auto r = job.wait(std::chrono::steady_clock::now() + 300s);
  INFO(r.describe());
  CHECK(r.ok());  // the restarted generation trained to the end
  CHECK_THAT(r.output, Catch::Contains("rank 1 (host"));
  CHECK_THAT(r.output, Catch::Contains("exited or was killed"));
  CHECK_THAT(r.output, Catch::Contains("restarting the workers in a new generation"));
  CHECK_THAT(r.output, Catch::Contains("step 400/400"));
}

TEST_CASE("SIGINT to trnrun stops every stage at the same step with one line each") {
  TempDir dir;
  const Layout l{1, 1, 2, "1f1b", 1, 4};
  auto prog = train_cmd(dir.path(), "s", l, {"--n-layer", "4", "--steps", "100000", "--log-every", "1"});
  Process job(ProcSpec{trnrun(2, prog), {}});
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (job.output_so_far().find("step 5/") == std::string::npos && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);
  job.signal(SIGINT);
  auto r = job.wait(std::chrono::steady_clock::now() + 120s);
  INFO(r.describe());
  CHECK(r.exit_code == 130);
  std::regex stopped("\\[rank ([01])\\] trn-train: stopped by [A-Za-z]+ after step ([0-9]+) of 100000");
  std::map<std::string, std::string> step_of;
  for (std::sregex_iterator it(r.output.begin(), r.output.end(), stopped), end; it != end; ++it)
    step_of[(*it)[1]] = (*it)[2];
  REQUIRE(step_of.size() == 2);
  CHECK(step_of["0"] == step_of["1"]);
}
