// A rank killed over tcp: every survivor fails soon, naming it or a rank that failed on it first,
// whoever it was waiting for (peer_watch.h). The job is the one users run: trn-collbench bootstrapped through a store
// directory, all-reducing 1 MiB..64 MiB, one rank killed with SIGKILL once all are running.
#include <signal.h>

#include <regex>
#include <thread>

#include "tests/integration/fabric/world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The rank the first "rank L (host H) was lost" line of a survivor's output names, or -1.
int first_lost(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("rank ([0-9]+) \\(host [^)]*\\)\\s+was lost"))) return -1;
  return std::stoi(m[1]);
}

// Starts n ranks of trn-collbench, kills rank victim once every rank is up, and returns the
// survivors' results and the seconds from the kill to the last survivor's exit.
std::vector<ProcResult> kill_one(int n, int victim, const std::map<std::string, std::string>& extra, double* seconds) {
  TempDir dir;
  std::vector<std::unique_ptr<Process>> ps;
  for (int r = 0; r < n; ++r) {
    std::map<std::string, std::string> env = {{"TRN_RANK", std::to_string(r)}, {"TRN_WORLD_SIZE", std::to_string(n)},
                                              {"TRN_STORE_DIR", dir.path()}, {"TRN_TIMEOUT", "120"},
                                              {"TRN_LOG_LEVEL", "info"}, {"TRN_LOG_SUBSYS", "fabric"}};
    for (const auto& [k, v] : extra) env[k] = v;
    ps.push_back(std::make_unique<Process>(
        ProcSpec{{bin("trn-collbench"), "-b", "1M", "-e", "64M", "-n", "200"}, env}));
  }
  const auto start_by = Clock::now() + 60s;
  for (auto& p : ps)
    while (!contains(p->output_so_far(), "fabric up") && p->running() && Clock::now() < start_by)
      std::this_thread::sleep_for(20ms);
  std::this_thread::sleep_for(500ms);  // into the all-reduces
  ps[victim]->signal(SIGKILL);
  const auto killed = Clock::now();
  std::vector<ProcResult> rs;
  for (int r = 0; r < n; ++r) rs.push_back(ps[r]->wait(killed + 100s));
  *seconds = std::chrono::duration<double>(Clock::now() - killed).count();
  return rs;
}

}  // namespace

TEST_CASE("a rank killed over tcp fails every survivor soon, naming it", "[integration]") {
  const std::map<std::string, std::string> tcp = {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}};
  for (auto [n, victim] : {std::pair{3, 1}, {3, 2}, {4, 0}, {4, 2}}) {
    double seconds = 0;
    auto rs = kill_one(n, victim, tcp, &seconds);
    std::printf("%d ranks, rank %d killed: the survivors ended %.2f s after the kill\n", n, victim, seconds);
    for (int r = 0; r < n; ++r) {
      INFO(n << " ranks, rank " << victim << " killed; rank " << r << ": " << rs[r].describe());
      if (r == victim) {
        CHECK(rs[r].signal == SIGKILL);
        continue;
      }
      CHECK(rs[r].exit_code == 1);
      CHECK_FALSE(rs[r].timed_out);
      CHECK(contains(rs[r].output, "was lost"));
      // The first loss a survivor sees is the victim, or a survivor that failed on the victim
      // first and left (its connections reset before the victim's did, when this rank was
      // waiting on it): the chain of names leads to the victim either way.
      const int lost = first_lost(rs[r].output);
      INFO("rank " << r << " first names rank " << lost);
      CHECK((lost == victim || (lost >= 0 && lost < n && lost != r && first_lost(rs[lost].output) == victim)));
    }
    CHECK(seconds < 30);  // TRN_TIMEOUT is 120 s: the survivors did not wait for it
  }
}
