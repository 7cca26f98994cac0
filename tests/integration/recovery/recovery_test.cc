// Recovery in place with the real programs: trnrun --recovery in-place starts trn-train workers
// with --snapshot-every; the test kill -9s workers while they train. The survivors must keep
// their processes, only the killed rank is started again, it gets its state from a buddy's
// memory, and the final weights must equal a fault-free run's byte for byte.
#include <catch2/catch.hpp>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tests/integration/coordinator/coordinator_process.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {


// The trn-train workers a trnrun started: rank -> pid (its children whose command is trn-train).
std::map<int, pid_t> workers_of(pid_t trnrun) {
  std::map<int, pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = file_bytes(e.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != trnrun || state == 'Z') continue;
    if (file_bytes(e.path().string() + "/cmdline").find("trn-train") == std::string::npos) continue;
    const std::string env = file_bytes(e.path().string() + "/environ");
    std::smatch m;
    if (std::regex_search(env, m, std::regex("TRN_RANK=(\\d+)"))) out[std::stoi(m[1])] = pid_t(std::stol(name));
  }
  return out;
}

// Polls p's output until pred holds or 120 s pass.
bool wait_until(Process& p, const std::function<bool(const std::string&)>& pred) {
  const auto deadline = std::chrono::steady_clock::now() + 120s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred(p.output_so_far())) return true;
    if (!p.running()) return pred(p.output_so_far());
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

std::vector<std::string> train_args(const std::string& save, const std::vector<std::string>& layout,
                                    std::vector<std::string> extra, int steps = 200) {
  std::vector<std::string> c = {bin("trn-train"), "--model", "tiny", "--steps", std::to_string(steps), "--batch-size", "8",
                                "--seq-len", "64", "--log-every", "5", "--save", save};
  c.insert(c.end(), layout.begin(), layout.end());
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

// The steps each "recovery N: ... K steps lost" line of output reports, in order.
std::vector<int> steps_lost(const std::string& output) {
  std::vector<int> out;
  static const std::regex re(R"(recovery \d+: .*; (\d+) steps? lost)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it)
    out.push_back(std::stoi((*it)[1]));
  return out;
}

}  // namespace

TEST_CASE("kill -9 of workers: survivors keep their processes and the weights equal a clean run's") {
  struct Case {
    std::vector<std::string> layout;
    int kills;
    int max_lost;  // per recovery
  };
  // dp 2 and cp 2: the replica (which holds the same weights) holds the copy (nothing sent,
  // nothing lost). tp, pp and ZeRO send their snapshots to the buddy: one in flight at the kill
  // may cost the step it was of.
  const std::vector<Case> cases = {{{"--dp", "2"}, 3, 0},
                                   {{"--cp", "2"}, 2, 0},
                                   {{"--tp", "2"}, 2, 1},
                                   {{"--pp", "2", "--micro-batches", "2"}, 2, 1},
                                   {{"--dp", "2", "--zero", "3"}, 3, 1},
                                   // MoE with the balancing bias (model state the optimizer never moves).
                                   {{"--model", "mixtral-tiny", "--moe-balance", "bias", "--tp", "2"}, 2, 1},
                                   // Expert parallelism: the expert ranks hold different experts, so
                                   // they send their snapshots to the buddy like ZeRO's shards.
                                   {{"--model", "mixtral-tiny", "--dp", "2", "--ep", "2"}, 2, 1}};
  // Kill k lands after step 20 + 30 k (the last at 80), leaving 40 steps after it: every kill
  // hits a running job, and each recovery is done before the next kill.
  const int steps = 120;
  for (const auto& c : cases) {
    std::string name;
    for (const auto& a : c.layout) name += a + " ";
    DYNAMIC_SECTION(name) {
      TempDir dir;
      const std::string clean = dir.path() + "/clean.safetensors",
                        recovered = dir.path() + "/recovered.safetensors";
      {
        auto r = run_all({ProcSpec{trnrun_cmd(2, train_args(clean, c.layout, {}, steps)), {}}}, 240s).at(0);
        INFO(r.describe());
        REQUIRE(r.ok());
      }
      Process p(ProcSpec{trnrun_cmd(2, train_args(recovered, c.layout, {"--snapshot-every", "1"}, steps),
                                    {"--recovery", "in-place", "--max-restarts", std::to_string(c.kills)}),
                         {}});
      for (int k = 0; k < c.kills; ++k) {
        const int64_t at = 20 + 30 * k;
        REQUIRE(wait_until(p, [&](const std::string& out) { return newest_step(out) >= at; }));
        const auto before = workers_of(p.pid());
        REQUIRE(before.size() == 2);
        const int victim = k % 2 == 0 ? 1 : 0, survivor = 1 - victim;
        INFO("kill " << k + 1 << ": rank " << victim << " (pid " << before.at(victim) << ") after step " << at);
        REQUIRE(::kill(before.at(victim), SIGKILL) == 0);
        const std::string done = fmt::format("recovery {}:", k + 1);
        REQUIRE(wait_until(p, [&](const std::string& out) { return out.find(done) != std::string::npos; }));
        const auto after = workers_of(p.pid());
        REQUIRE(after.size() == 2);
        CHECK(after.at(survivor) == before.at(survivor));  // the survivor recovered in its own process
        CHECK(after.at(victim) != before.at(victim));      // only the killed rank was started again
      }
      auto r = p.wait(std::chrono::steady_clock::now() + 240s);
      INFO(r.describe());
      REQUIRE(r.ok());
      const auto lost = steps_lost(r.output);
      REQUIRE(lost.size() == size_t(c.kills));
      for (int l : lost) CHECK(l <= c.max_lost);
      CHECK(count_lines_with(r.output, fmt::format("{} recover{} in place", c.kills, c.kills == 1 ? "y" : "ies")) == 1);
      CHECK(file_bytes(recovered) == file_bytes(clean));
    }
  }
}

TEST_CASE("a hung worker (SIGSTOP) is replaced once the coordinator's heartbeat timeout declares it dead") {
  TempDir dir;
  CoordinatorProcess coordinator(dir.path(), {"--heartbeat-timeout", "4"});
  const std::vector<std::string> layout = {"--dp", "2"};
  const std::string clean = dir.path() + "/clean.safetensors", recovered = dir.path() + "/recovered.safetensors";
  {
    auto r = run_all({ProcSpec{trnrun_cmd(2, train_args(clean, layout, {})), {}}}, 240s).at(0);
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  // Heartbeats every 0.5 s: the agent calls a worker hung after 2 s of silence, inside the
  // coordinator's 4 s.
  Process p(ProcSpec{trnrun_cmd(2, train_args(recovered, layout, {"--snapshot-every", "1"}),
                                {"--coordinator", coordinator.address(), "--recovery", "in-place", "--max-restarts",
                                 "1"}),
                     {{"TRN_HEARTBEAT_INTERVAL", "0.5"}}});
  REQUIRE(wait_until(p, [&](const std::string& out) { return newest_step(out) >= 30; }));
  const auto before = workers_of(p.pid());
  REQUIRE(before.size() == 2);
  REQUIRE(::kill(before.at(1), SIGSTOP) == 0);
  REQUIRE(wait_until(p, [&](const std::string& out) { return out.find("recovery 1:") != std::string::npos; }));
  const auto after = workers_of(p.pid());
  REQUIRE(after.size() == 2);
  CHECK(after.at(0) == before.at(0));
  CHECK(after.at(1) != before.at(1));
  CHECK(::kill(before.at(1), 0) != 0);  // the hung process is gone
  // The recovery reaches the coordinator with rank 0's next heartbeats: trnctl status shows it.
  bool shown = false;
  for (int i = 0; i < 50 && !shown; ++i) {
    auto st = run_all({ProcSpec{{bin("trnctl"), "--coordinator", coordinator.address(), "status"}, {}}}, 30s).at(0);
    shown = st.output.find("recoveries 1 (last:") != std::string::npos;
    if (!shown) std::this_thread::sleep_for(100ms);
  }
  CHECK(shown);
  auto r = p.wait(std::chrono::steady_clock::now() + 240s);
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(r.output.find("missed heartbeats") != std::string::npos);
  CHECK(file_bytes(recovered) == file_bytes(clean));
}
