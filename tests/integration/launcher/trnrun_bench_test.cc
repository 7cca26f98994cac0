// Benchmark, printed not asserted: trnrun against torchrun (PyTorch's elastic launcher, the
// anchor) on this machine, alternating the two, medians of several launches:
//  - launch: wall time of a whole 2-worker job whose workers do nothing;
//  - restart: time from a worker's failure to the first worker of the next generation starting.
// Both launchers run the same /bin/sh worker; both log to files and tee to the console
// (torchrun --redirects 1 --tee 1, trnrun --log-dir --tee) and check workers every 0.1 s.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>

#include "tests/integration/launcher/launcher_children.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

const char* kWorker = R"SH(#!/bin/sh
RANK_=${TRN_RANK:-$RANK}
GEN=${TRN_GENERATION:-$TORCHELASTIC_RESTART_COUNT}
echo "start rank=$RANK_ gen=$GEN t=$(date +%s%N)"
if [ "$BENCH_MODE" = fail ] && [ "$GEN" = 0 ]; then
  if [ "$RANK_" = 1 ]; then echo "fail t=$(date +%s%N)"; exit 1; fi
  exec sleep 60
fi
exit 0
)SH";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Sample {
  double wall_s = 0;
  double restart_s = -1;
};

Sample measure(const std::vector<std::string>& argv, const std::string& mode) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_all({ProcSpec{argv, {{"BENCH_MODE", mode}, {"OMP_NUM_THREADS", "1"}}}}, 120s)[0];
  Sample s;
  s.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.describe());
  REQUIRE(r.ok());
  if (mode == "fail") {
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex(R"(fail t=(\d+))")));
    double fail_ns = std::stod(m[1].str());
    double first = 0;
    std::regex start(R"(start rank=\d gen=1 t=(\d+))");
    for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), start); it != std::sregex_iterator(); ++it) {
      double t = std::stod((*it)[1].str());
      if (first == 0 || t < first) first = t;
    }
    REQUIRE(first > 0);
    s.restart_s = (first - fail_ns) / 1e9;
  }
  return s;
}

}  // namespace

TEST_CASE("benchmark: trnrun vs torchrun launch time and restart latency", "[slow]") {
  if (system("/usr/bin/python3 -c 'import torch.distributed.run' >/dev/null 2>&1") != 0) {
    WARN("torchrun (python3-torch) is not installed: no anchor, benchmark skipped");
    return;
  }
  TempDir dir;
  std::string worker = dir.path() + "/worker.sh";
  std::ofstream(worker) << kWorker;
  std::filesystem::permissions(worker, std::filesystem::perms::owner_all);
  const int kRuns = 5;
  std::map<std::string, std::vector<double>> launch, restart;
  for (int run = 0; run < kRuns; ++run) {
    for (const std::string mode : {"ok", "fail"}) {
      std::string logs = dir.path() + "/logs" + std::to_string(run) + mode;
      auto trn = measure({bin("trnrun"), "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
                          "--log-dir", logs + "-trn", "--tee", worker},
                         mode);
      auto torch = measure({"/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "--max_restarts", "1", "--monitor_interval", "0.1", "--redirects", "1", "--tee", "1",
                            "--log_dir", logs + "-torch", "--no_python", worker},
                           mode);
      if (mode == "ok") {
        launch["trnrun"].push_back(trn.wall_s);
        launch["torchrun"].push_back(torch.wall_s);
      } else {
        restart["trnrun"].push_back(trn.restart_s);
        restart["torchrun"].push_back(torch.restart_s);
      }
    }
  }
  std::string table = fmt::format(
      "launcher benchmark, 2 workers, medians of {} alternating runs\n"
      "  {:<10} {:>14} {:>18}\n"
      "  {:<10} {:>14.3f} {:>18.3f}\n"
      "  {:<10} {:>14.3f} {:>18.3f}\n",
      kRuns, "", "job wall (s)", "fail->restart (s)", "trnrun", median(launch["trnrun"]),
      median(restart["trnrun"]), "torchrun", median(launch["torchrun"]), median(restart["torchrun"]));
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
}
