// Every trn program that takes an address checks it with the one parser (launcher/client/
// address.h): a port outside its range or a host that is no name, IPv4 address or [IPv6] is one
// usage line naming the flag (or variable) and the valid range, exit 2, before anything dials or
// listens. Never a wrapped port (99999 dialled as 34463) or a retried connection.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

namespace {

struct Case {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  std::string program, named, range;  // the line starts "program: error: named", and names range
};

void check_refused(const Case& c) {
  std::vector<std::string> argv = c.argv;
  argv[0] = bin(argv[0]);
  const ProcResult r = run_all({ProcSpec{argv, c.env}}, 60s).at(0);
  INFO(fmt::format("{}", fmt::join(c.argv, " ")) << "\n" << r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::StartsWith(c.program + ": error: " + c.named + " "));
  CHECK_THAT(r.output, Catch::Contains("expected HOST:PORT with a port in " + c.range));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}

}  // namespace

// --timeout, --join-timeout and TRN_TIMEOUT bound what a program that took the address would do
// with it, so a regression fails in seconds rather than at the test's deadline.
TEST_CASE("a port out of range or a malformed host is one usage line naming the flag and the range, in every program") {
  const std::string self_pid = std::to_string(::getpid());
  const std::vector<Case> cases = {
      // trnctl: the case (gRPC dialled port 34463), from the flag and from TRN_COORDINATOR.
      {{"trnctl", "--coordinator", "127.0.0.1:99999", "--timeout", "3", "status"}, {}, "trnctl", "--coordinator", "1-65535"},
      {{"trnctl", "--timeout", "3", "status"}, {{"TRN_COORDINATOR", "127.0.0.1:0"}}, "trnctl", "TRN_COORDINATOR", "1-65535"},
      {{"trnctl", "--coordinator", "::1:7000", "--timeout", "3", "status"}, {}, "trnctl", "--coordinator", "1-65535"},
      {{"trnctl", "--coordinator", "127.0.0.1:1,[zz::q]:7000", "--timeout", "3", "status"}, {}, "trnctl",
       "--coordinator", "1-65535"},
      // trnrun: host syntax (the port range was checked already).
      {{"trnrun", "--coordinator", "10.0.0.256:7000", "--join-timeout", "3", "true"}, {}, "trnrun", "--coordinator",
       "1-65535"},
      {{"trnrun", "--coordinator", "bad host:7000", "--join-timeout", "3", "true"}, {}, "trnrun", "--coordinator",
       "1-65535"},
      // trn-coordinator: --listen takes port 0 (any free port), --advertise and etcd endpoints do not.
      {{"trn-coordinator", "--listen", "no_such$host:0"}, {}, "trn-coordinator", "--listen", "0-65535"},
      {{"trn-coordinator", "--listen", "127.0.0.1:65536"}, {}, "trn-coordinator", "--listen", "0-65535"},
      {{"trn-coordinator", "--listen", "127.0.0.1:0", "--store", "etcd://127.0.0.1:1", "--advertise", "127.0.0.1:0"},
       {}, "trn-coordinator", "--advertise", "1-65535"},
      // trn-coordbench, against a coordinator given by address.
      {{"trn-coordbench", "--coordinator", "127.0.0.1:99999", "--coordinator-pid", self_pid, "--workers", "1",
        "--seconds", "1"},
       {}, "trn-coordbench", "--coordinator", "1-65535"},
      // A worker (trn-train) takes the coordinator from TRN_COORDINATOR.
      {{"trn-train", "--model", "tiny", "--steps", "1", "--batch-size", "2", "--seq-len", "16"},
       {{"TRN_COORDINATOR", "127.0.0.1:99999"}, {"TRN_JOB_ID", "j"}, {"TRN_RANK", "0"}, {"TRN_WORLD_SIZE", "1"},
        {"TRN_TIMEOUT", "3"}},
       "trn-train", "TRN_COORDINATOR", "1-65535"},
  };
  for (const auto& c : cases) check_refused(c);
}

TEST_CASE("an etcd endpoint whose host is no address is refused in one line before trn-coordinator listens") {
  const ProcResult r =
      run_all({ProcSpec{{bin("trn-coordinator"), "--listen", "127.0.0.1:0", "--store", "etcd://[zz]:2379",
                         "--advertise", "127.0.0.1:7000"},
                        {}}},
              30s)
          .at(0);
  INFO(r.describe());
  CHECK_FALSE(r.timed_out);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::StartsWith("trn-coordinator: error: malformed etcd URL 'etcd://[zz]:2379'"));
  CHECK_THAT(r.output, Catch::Contains("[zz] is not an IPv6 address"));
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
}
