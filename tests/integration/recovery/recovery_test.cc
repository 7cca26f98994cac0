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

#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The trn-train workers a trnrun started: rank -> pid (its children whose command is trn-train).
std::map<int, pid_t> workers_of(pid_t trnrun) {
  std::map<int, pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string stat = read_file(e.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != trnrun || state == 'Z') continue;
    if (read_file(e.path().string() + "/cmdline").find("trn-train") == std::string::npos) continue;
    const std::string env = read_file(e.path().string() + "/environ");
    std::smatch m;
    if (std::regex_search(env, m, std::regex("TRN_RANK=(\\d+)"))) out[std::stoi(m[1])] = pid_t(std::stol(name));
  }
  return out;
}

// The newest "step N/" a progress line of output reports.
int64_t newest_step(const std::string& output) {
  int64_t best = 0;
  static const std::regex re(R"(step (\d+)/\d+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it)
    best = std::max<int64_t>(best, std::stoll((*it)[1]));
  return best;
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

std::vector<std::string> train_args(const std::string& save, std::vector<std::string> extra) {
  std::vector<std::string> c = {bin("trn-train"), "--model", "tiny", "--steps", "240", "--batch-size", "8",
                                "--seq-len", "64", "--log-every", "5", "--dp", "2", "--save", save};
  c.insert(c.end(), extra.begin(), extra.end());
  return c;
}

}  // namespace

TEST_CASE("kill -9 of data-parallel workers: the survivor keeps its process and the weights equal a clean run's") {
  TempDir dir;
  const std::string clean = dir.path() + "/clean.safetensors", recovered = dir.path() + "/recovered.safetensors";
  {
    auto r = run_all({ProcSpec{trnrun_cmd(2, train_args(clean, {})), {}}}, 240s).at(0);
    INFO(r.describe());
    REQUIRE(r.ok());
  }
  Process p(ProcSpec{trnrun_cmd(2,
                                train_args(recovered, {"--snapshot-every", "1", "--metrics-jsonl",
                                                       dir.path() + "/m.jsonl"}),
                                {"--recovery", "in-place", "--max-restarts", "3"}),
                     {}});
  for (int k = 0; k < 3; ++k) {
    const int64_t at = 30 + 60 * k;
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
  // Nothing that completed before a kill ran again: the replica held every step.
  CHECK(count_lines_with(r.output, "; 0 steps lost,") == 3);
  CHECK(count_lines_with(r.output, "3 recoveries in place") == 1);
  CHECK(read_file(recovered) == read_file(clean));
}
