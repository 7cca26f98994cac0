// trn-plan as a user runs it: calibrate on this machine, then a ranked plan and one layout's
// prediction from the file it wrote; a 16,384-rank trn2 plan; a deep model's search answers, and
// a signal ends it; bad input is one line and exit 2.
#include <csignal>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "tests/support/process.h"

using namespace std::chrono_literals;
using Catch::Matchers::Contains;
using trn::test::bin;

namespace {

trn::test::ProcResult plan(std::vector<std::string> args, std::chrono::seconds timeout = 120s) {
  args.insert(args.begin(), bin("trn-plan"));
  return trn::test::run_all({{args, {{"OPENBLAS_NUM_THREADS", "1"}}}}, timeout)[0];
}

// The last line of a program's output (its one error line).
std::string last_line(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s.substr(s.find_last_of('\n') + 1);
}

// The --json document of an output whose search reported its progress on stderr first.
nlohmann::json json_of(const std::string& out) { return nlohmann::json::parse(out.substr(out.find("{\n"))); }

}  // namespace

TEST_CASE("trn-plan calibrates this machine, then ranks layouts and predicts one") {
  const std::string dir = std::filesystem::temp_directory_path() / "trn_plan_it";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/local.json";
  const auto cal = plan({"calibrate", "--model", "tiny", "--seq-len", "32", "--max-tp", "2", "--max-batch",
                         "2", "--repeats", "1", "--out", file},
                        300s);
  INFO(cal.output);
  REQUIRE(cal.ok());
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(file));
  CHECK(j["format"] == "trn-local-cluster");
  CHECK(j["calibration"]["pieces"].size() == 4);  // tp 1 and 2, micro-batches 1 and 2
  CHECK(j["calibration"]["base_rss_mib"].get<double>() > 0);
  // Real steps against the pieces, and a ring of more ranks than cores (0 where its times did
  // not fit a link: a busy host).
  CHECK(j["calibration"]["step_scale"].get<double>() > 0);
  CHECK(j["calibration"]["busy_scale"].get<double>() >= 1);
  CHECK(j["calibration"]["oversubscribed_alpha_us"].get<double>() >= 0);
  CHECK(j["calibration"]["oversubscribed_behind_alpha_us"].get<double>() >=
        j["calibration"]["oversubscribed_alpha_us"].get<double>());
  CHECK(j["calibration"]["zero3_scale"].get<double>() >= 1);
  CHECK(j["calibration"]["ranks_scale"].get<double>() >= 1);
  // The links as probe-link measured them: both transports, each a latency and a cost per byte.
  CHECK_THAT(j["links"].get<std::string>(), Contains("probe-link"));
  for (const char* link : {"intra_node", "inter_node"}) {
    INFO(link);
    CHECK(j[link]["alpha_us"].get<double>() >= 1);
    CHECK(j[link]["beta_us_per_kib"].get<double>() > 0);
  }

  const auto ranked = plan({"--model", "tiny", "--seq-len", "32", "--cluster", "local:" + file,
                            "--global-batch", "4", "--json", "--top", "50"});
  REQUIRE(ranked.ok());
  const nlohmann::json r = nlohmann::json::parse(ranked.output);
  REQUIRE(r["layouts"].size() > 2);
  double prev = 0;
  for (const auto& l : r["layouts"]) {
    if (!l["fits"].get<bool>()) continue;
    CHECK(l["step_s"].get<double>() >= prev);
    prev = l["step_s"].get<double>();
    CHECK(l["tp"].get<int>() <= 2);
  }

  const auto one = plan({"--model", "tiny", "--seq-len", "32", "--cluster", "local:" + file, "--global-batch",
                         "4", "--layout", "--dp 2 --pp 2 --micro-batches 2 --schedule zb", "--json"});
  REQUIRE(one.ok());
  const nlohmann::json o = nlohmann::json::parse(one.output)["layouts"][0];
  CHECK(o["flags"] == "--dp 2 --tp 1 --pp 2 --micro-batches 2 --schedule zb");
  CHECK(o["step_s"].get<double>() > 0);
  CHECK(o["memory"]["total"].get<double>() > o["memory"]["weights"].get<double>());

  // The calibration is for one model and sequence length.
  const auto other =
      plan({"--model", "small", "--seq-len", "32", "--cluster", "local:" + file, "--global-batch", "4"});
  CHECK(other.exit_code == 2);
  CHECK_THAT(last_line(other.output), Contains("run trn-plan calibrate"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("trn-plan plans a 16,384-rank trn2 job") {
  const auto r = plan({"--arch",         "llama",
                       "--n-layer",      "32",
                       "--d-model",      "4096",
                       "--n-head",       "32",
                       "--n-kv-head",    "8",
                       "--ffn-dim",      "14336",
                       "--vocab",        "128256",
                       "--ctx",          "8192",
                       "--precision",    "bf16",
                       "--seq-len",      "8192",
                       "--cluster",      "trn2.48xlarge:1024",
                       "--global-batch", "1024",
                       "--top",          "5"});
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Contains("16384 ranks"));
  CHECK_THAT(r.output, Contains("fastest"));
  CHECK_THAT(r.output, Contains("MFU"));
  // The trn2 file names Trainium's E4M3 for the fp8 wire, and a --layout with it runs it.
  CHECK_THAT(r.output,
             Contains("--grad-comm fp8 on this cluster: --fp8-format neuron (E4M3, largest value 240)"));
  const auto one = plan({"--model", "tiny", "--cluster", "trn2.48xlarge:1", "--global-batch", "16",
                         "--layout", "--dp 16 --grad-comm fp8"});
  INFO(one.output);
  REQUIRE(one.ok());
  CHECK_THAT(one.output, Contains("--dp 16 --tp 1 --pp 1 --grad-comm fp8 --fp8-format neuron"));
}

TEST_CASE("trn-plan splits a 32,768-token sequence over cp ranks, and predicts a --layout with --cp") {
  const std::vector<std::string> job = {"--model", "llama-3.1-70b", "--precision", "bf16", "--seq-len", "32768",
                                        "--cluster", "trn2.48xlarge:256", "--global-batch", "2048", "--json"};
  auto with = job, without = job;
  with.insert(with.end(), {"--top", "1"});
  without.insert(without.end(), {"--top", "100000", "--max-cp", "1"});
  const auto a = plan(with), b = plan(without);
  INFO(a.describe());
  REQUIRE(a.ok());
  const nlohmann::json best = json_of(a.output)["layouts"][0];
  CHECK(best["fits"].get<bool>());
  CHECK(best["cp"].get<int>() > 1);
  CHECK_THAT(best["flags"].get<std::string>(), Contains("--cp "));
  CHECK(best["breakdown"]["cp_comm_s"].get<double>() > 0);
  // Without context parallelism every layout has cp 1, and the fastest that fits (if any) is slower.
  const nlohmann::json none = json_of(b.output)["layouts"];
  for (const auto& l : none) {
    CHECK(l["cp"].get<int>() == 1);
    if (l["fits"].get<bool>()) CHECK(l["step_s"].get<double>() > best["step_s"].get<double>());
  }

  auto one = job;
  one.insert(one.end(), {"--layout", "--dp 512 --tp 4 --cp 2 --cp-comm all-to-all --zero 3 --recompute full"});
  const auto o = plan(one);
  INFO(o.describe());
  REQUIRE(o.ok());
  const nlohmann::json l = json_of(o.output)["layouts"][0];
  CHECK(l["flags"] == "--dp 512 --tp 4 --pp 1 --cp 2 --cp-comm all-to-all --zero 3 --recompute full");
  CHECK(l["cp_comm"] == "all-to-all");
  // A cp check() refuses is one line, never a plan.
  auto bad = job;
  bad.insert(bad.end(), {"--layout", "--dp 512 --tp 8 --cp 2 --cp-comm all-to-all"});
  const auto r = plan(bad);
  CHECK(r.exit_code == 2);
  CHECK_THAT(last_line(r.output), Contains("use --cp-comm ring"));
}

TEST_CASE("trn-plan searches --ep for a mixture of experts, bounded by --max-ep, and predicts a --layout with --ep") {
  // mixtral-tiny (4 experts) on one trn1 node's 16 ranks.
  const std::vector<std::string> job = {"--model",   "mixtral-tiny",      "--seq-len",      "64", "--cluster",
                                        "trn1.32xlarge:1", "--global-batch", "16", "--json"};
  auto eps_of = [&](std::vector<std::string> extra) {
    auto args = job;
    args.insert(args.end(), {"--top", "100000"});
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = plan(args);
    INFO(r.describe());
    REQUIRE(r.ok());
    std::set<int> eps;
    const nlohmann::json out = json_of(r.output);
    for (const auto& l : out["layouts"]) {
      const int ep = l["ep"].get<int>();
      eps.insert(ep);
      if (ep > 1) {
        CHECK_THAT(l["flags"].get<std::string>(), Contains("--ep " + std::to_string(ep)));
        if (l["timed"].get<bool>()) CHECK(l["breakdown"]["ep_comm_s"].get<double>() > 0);
      }
    }
    return eps;
  };
  CHECK(eps_of({}) == std::set<int>{1, 2, 4});
  CHECK(eps_of({"--max-ep", "2"}) == std::set<int>{1, 2});
  CHECK(eps_of({"--max-ep", "1"}) == std::set<int>{1});

  auto one = job;
  one.insert(one.end(), {"--layout", "--dp 16 --ep 4"});
  const auto o = plan(one);
  INFO(o.describe());
  REQUIRE(o.ok());
  const nlohmann::json l = json_of(o.output)["layouts"][0];
  CHECK(l["flags"] == "--dp 16 --tp 1 --pp 1 --ep 4");
  CHECK(l["breakdown"]["ep_comm_s"].get<double>() > 0);
  // An ep check() refuses is one line, never a plan.
  auto bad = job;
  bad.insert(bad.end(), {"--layout", "--dp 16 --ep 8"});
  const auto r = plan(bad);
  CHECK(r.exit_code == 2);
  CHECK_THAT(last_line(r.output), Contains("must divide the 4 experts"));
  // The MoE shape flags are model flags (calibrate's link probe gets the model as
  // Config::flags() spells it): with --n-experts 8 and --top-k 1 the same ep 8 layout runs.
  auto eight = bad;
  eight.insert(eight.end(), {"--n-experts", "8", "--top-k", "1", "--moe-norm-topk", "0"});
  const auto e = plan(eight);
  INFO(e.describe());
  REQUIRE(e.ok());
  CHECK(json_of(e.output)["layouts"][0]["ep"] == 8);

  // Measured routing (trn-train --metrics-moe-loads): every layer's tokens on experts 0 and 1,
  // the ep 4 layout's first rank, which the others wait for.
  trn::test::TempDir dir;
  const std::string loads = dir.path() + "/metrics.jsonl";
  {
    std::ofstream f(loads);
    f << R"({"step": 1, "loss": 5, "moe_loads": [[64, 64, 0, 0], [64, 64, 0, 0]]})"
         "\n";
  }
  auto measured = one;
  measured.insert(measured.end(), {"--moe-loads", loads});
  const auto m = plan(measured);
  INFO(m.describe());
  REQUIRE(m.ok());
  const nlohmann::json ml = json_of(m.output);
  CHECK(ml["moe_loads"] == loads);
  CHECK(ml["layouts"][0]["breakdown"]["ep_comm_s"].get<double>() > l["breakdown"]["ep_comm_s"].get<double>());
  CHECK(ml["layouts"][0]["memory"]["activations"].get<double>() > l["memory"]["activations"].get<double>());
  // A dense model's plan with loads, loads of another shape: one line, exit 2.
  const auto dense = plan({"--model", "tiny", "--seq-len", "64", "--cluster", "trn1.32xlarge:1",
                           "--global-batch", "16", "--moe-loads", loads});
  CHECK(dense.exit_code == 2);
  CHECK_THAT(last_line(dense.output), Contains("--moe-loads: the model has no experts"));
  auto other = measured;
  other.insert(other.end(), {"--n-experts", "8"});
  const auto o8 = plan(other);
  CHECK(o8.exit_code == 2);
  CHECK_THAT(last_line(o8.output), Contains("are not 2 layers of 8 experts"));
}

TEST_CASE("trn-plan's bad input is one line and exit 2") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--model", "tiny", "--global-batch", "8"}, "--cluster is required"},
      {{"--model", "tiny", "--cluster", "trn2.48xlarge:2"}, "--global-batch is required"},
      {{"--model", "tiny", "--cluster", "h100:2", "--global-batch", "8"}, "no cluster file"},
      {{"--model", "tiny", "--cluster", "trn2.48xlarge:-1", "--global-batch", "8"}, "positive integer"},
      {{"--model", "tiny", "--cluster", "trn2.48xlarge:1", "--global-batch", "16", "--layout",
        "--tp 3 --dp 5"},
       "does not divide"},
      {{"--model", "nope", "--cluster", "trn2.48xlarge:1", "--global-batch", "8"}, "--model"},
      {{"--model", "tiny", "--cluster", "trn2.48xlarge:1", "--global-batch", "16", "--layout",
        "--dp 16 --grad-comm fp8 --fp8-format e5m2"},
       "--fp8-format takes ocp"},
      {{"calibrate", "--model", "tiny"}, "needs --out"},
      {{"frobnicate"}, "unknown command"},
      {{"probe-link", "--model", "tiny", "--seq-len", "32"}, "TRN_STORE_DIR"},
      // 2 layers, 4 heads and a batch of 8 reach 64 ranks at most: none of 8 nodes' 128.
      {{"--model", "tiny", "--seq-len", "128", "--cluster", "trn2.48xlarge:8", "--global-batch", "8"},
       "no layout uses all 128 ranks"},
  };
  for (const auto& [args, want] : cases) {
    const auto r = plan(args);
    INFO(r.output);
    CHECK(r.exit_code == 2);
    CHECK_THAT(last_line(r.output), Contains(want));
  }
}

namespace {

// Llama-3.1-70B's shape with n_layer blocks on 1,024 trn2 nodes (16,384 ranks).
std::vector<std::string> deep_70b(int n_layer) {
  return {"--model",   "llama-3.1-70b", "--n-layer", std::to_string(n_layer), "--precision",          "bf16",
          "--seq-len", "8192",          "--cluster", "trn2.48xlarge:1024",    "--global-batch", "2048"};
}

}  // namespace

TEST_CASE("trn-plan answers for a 4096-layer model: none of its layouts fits, one line, exit 2") {
  // The search counts memory before it simulates: the 12,606 layouts (shapes at ZeRO 0 to 3, each
  // with no, selective and full recomputation, and under tp with and without sequence
  // parallelism) are answered in a few seconds here (the deadline only keeps a regression from
  // hanging the suite). 1,024 layers fit with --recompute full --sequence-parallel. Context
  // parallelism is left out (--max-cp 1): at cp 4 and 8 twenty of the 4,096-layer layouts fit, as
  // pipelines of 128 and 256 stages with 512 to 2,048 micro-batches, whose simulation takes minutes.
  std::vector<std::string> args = deep_70b(4096);
  args.insert(args.end(), {"--max-cp", "1"});
  const auto r = plan(args, 90s);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == 2);
  CHECK_THAT(last_line(r.output), Contains("none of the 12606 layouts fits in a rank's memory"));
  CHECK_THAT(r.output, Contains("won't fit: needs"));
}

TEST_CASE("SIGINT and SIGTERM stop trn-plan's search with one line and exit 128 + signal") {
  for (int sig : {SIGINT, SIGTERM}) {
    INFO("signal " << sig);
    // 4,096 layers: a search of several seconds, which reports its progress each second.
    std::vector<std::string> args = deep_70b(4096);
    args.insert(args.begin(), bin("trn-plan"));
    trn::test::Process p({args, {{"OPENBLAS_NUM_THREADS", "1"}}});
    const auto until = std::chrono::steady_clock::now() + 60s;
    while (p.output_so_far().find("layouts evaluated") == std::string::npos && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(20ms);
    REQUIRE_THAT(p.output_so_far(), Contains("layouts evaluated"));
    p.signal(sig);
    const auto r = p.wait(std::chrono::steady_clock::now() + 60s);
    INFO(r.describe());
    CHECK(r.exit_code == 128 + sig);
    CHECK_THAT(last_line(r.output), Contains("trn-plan: stopped by"));
    CHECK_THAT(r.output, !Contains("layouts considered"));  // it stopped before the search ended
  }
}
