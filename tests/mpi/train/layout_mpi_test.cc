// trn-train under the real mpirun with a layout or a batch that does not fit the job: at every
// world size the job ends promptly with the one line that names the problem, exit 2.
#include <catch2/catch.hpp>

#include <sstream>

#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace std::chrono_literals;
using trn::test::count_lines_with;

TEST_CASE("under mpirun a layout or batch that does not fit the job is one line and exit 2 at any size", "[mpi]") {
  struct Case {
    int np;
    std::vector<std::string> flags;
    std::string line;
  };
  const std::vector<Case> cases = {
      {3, {"--dp", "2"}, "--dp 2 --tp 1 --pp 1 needs 2 workers but the job has 3"},
      {3, {"--tp", "2"}, "--dp 1 --tp 2 --pp 1 needs 2 workers but the job has 3"},
      {3, {}, "--batch-size 8 must divide evenly into the job's data-parallel replicas 3"},
      {4, {"--dp", "2"}, "--dp 2 --tp 1 --pp 1 needs 2 workers but the job has 4"},
      {6, {"--dp", "4"}, "--dp 4 --tp 1 --pp 1 needs 4 workers but the job has 6"},
  };
  // A rank that left after connecting used to strand the others in the world communicator's
  // start-up agreement and itself in MPI_Finalize; whether it did depended on timing, so each
  // case runs a few times.
  for (int attempt = 0; attempt < 3; ++attempt)
  for (const Case& c : cases) {
    std::vector<std::string> program = {trn::test::bin("trn-train"), "--steps", "2"};
    program.insert(program.end(), c.flags.begin(), c.flags.end());
    // A hang is cut off by the deadline.
    auto r = trn::test::run_all({{trn::test::mpirun_cmd(c.np, program), {{"TRN_LOG_LEVEL", "warn"}}}}, 30s)[0];
    INFO("attempt " << attempt << ", -np " << c.np << ": " << r.describe());
    CHECK_FALSE(r.timed_out);
    CHECK(r.exit_code == 2);
    // mpirun ends the job at the first rank's exit: at least one rank's line, and no other error.
    CHECK(count_lines_with(r.output, "trn-train: error: " + c.line) >= 1);
    CHECK(count_lines_with(r.output, "trn-train: error: ") == count_lines_with(r.output, c.line));
  }
}
