// Under mpirun, a rank's process killed (not mpirun): every survivor fails on its own, naming the
// dead rank. mpirun runs with --enable-recovery, so it does not kill the survivors itself and
// what they print is what trn noticed.
#include <catch2/catch.hpp>
#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tests/support/process.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The pid of mpirun's child whose OMPI_COMM_WORLD_RANK is rank, or -1.
pid_t rank_pid(pid_t mpirun, int rank) {
  DIR* d = opendir("/proc");
  pid_t found = -1;
  while (dirent* e = d ? readdir(d) : nullptr) {
    const pid_t pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(line.substr(paren + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != mpirun) continue;
    std::ifstream env(fmt::format("/proc/{}/environ", pid));
    std::string var;
    while (std::getline(env, var, '\0'))
      if (var == fmt::format("OMPI_COMM_WORLD_RANK={}", rank)) found = pid;
  }
  if (d) closedir(d);
  return found;
}

}  // namespace

TEST_CASE("under mpirun, a rank killed over tcp fails every survivor soon, naming it", "[mpi]") {
  for (const auto& [world, dead] : {std::pair{3, 1}, {4, 2}}) {
    const int n = world, victim = dead;  // named copies: clang 14 lambdas cannot capture bindings
    test::Process mpirun({{"mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "--tag-output",
                           "-np", std::to_string(n), "-x", "TRN_FABRIC_PROVIDER", "-x", "TRN_FABRIC_SHM", "-x",
                           "TRN_TIMEOUT", "-x", "TRN_LOG_LEVEL", "-x", "TRN_LOG_SUBSYS", test::bin("trn-collbench"),
                           "-b", "1M", "-e", "64M", "-n", "200"},
                          {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}, {"TRN_TIMEOUT", "120"},
                           {"TRN_LOG_LEVEL", "info"}, {"TRN_LOG_SUBSYS", "fabric"}}});
    const auto start_by = std::chrono::steady_clock::now() + 60s;
    auto up = [&] {
      const std::string& out = mpirun.output_so_far();
      for (int r = 0; r < n; ++r)
        if (!contains(out, fmt::format("[1,{}]<stderr>:", r)) || !contains(out, fmt::format("fabric up: rank {}/", r)))
          return false;
      return true;
    };
    while (!up() && mpirun.running() && std::chrono::steady_clock::now() < start_by) std::this_thread::sleep_for(20ms);
    std::this_thread::sleep_for(500ms);
    const pid_t pid = rank_pid(mpirun.pid(), victim);
    REQUIRE(pid > 0);
    kill(pid, SIGKILL);
    const auto killed = std::chrono::steady_clock::now();
    test::ProcResult r = mpirun.wait(killed + 100s);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
    std::printf("mpirun, %d ranks, rank %d killed: mpirun ended %.2f s after the kill\n", n, victim, seconds);
    INFO(r.describe());
    CHECK_FALSE(r.timed_out);
    for (int q = 0; q < n; ++q) {
      if (q == victim) continue;
      INFO("rank " << q);
      // Each survivor's last line: "trn-collbench: ...rank <victim> (host ...) was lost..."
      const std::string tag = fmt::format("[1,{}]<stderr>:trn-collbench: ", q);
      const size_t at = r.output.find(tag);
      REQUIRE(at != std::string::npos);
      const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
      CHECK(contains(line, fmt::format("rank {} (host ", victim)));
      CHECK(contains(line, "was lost"));
    }
    CHECK(seconds < 30);  // TRN_TIMEOUT is 120 s
  }
}
