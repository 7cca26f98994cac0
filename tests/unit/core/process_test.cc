#include <catch2/catch.hpp>
#include <signal.h>
#include <unistd.h>

#include <thread>

#include "tests/support/process.h"

using namespace trn::test;
using namespace std::chrono_literals;

TRN_TEST_CHILD(sleeper) {
  std::printf("started\n");
  std::fflush(stdout);
  std::this_thread::sleep_for(std::chrono::seconds(std::stoi(args.at(0))));
  return 0;
}

TRN_TEST_CHILD(exit_with) {
  std::printf("env=%s\n", getenv("TRN_TEST_VALUE"));
  return std::stoi(args.at(0));
}

TEST_CASE("the process helper collects exit codes, output and environment") {
  auto rs = run_all({child("exit_with", {"0"}, {{"TRN_TEST_VALUE", "a"}}),
                     child("exit_with", {"3"}, {{"TRN_TEST_VALUE", "b"}})},
                    30s);
  CHECK(rs[0].exit_code == 0);
  CHECK(rs[0].output == "env=a\n");
  CHECK(rs[1].exit_code == 3);
  CHECK(rs[1].output == "env=b\n");
}

TEST_CASE("the process helper kills stragglers at the deadline") {
  auto rs = run_all({child("sleeper", {"1000"}), child("exit_with", {"0"})}, 2s);
  CHECK(rs[0].timed_out);
  CHECK(rs[0].signal == SIGKILL);
  CHECK(rs[0].output == "started\n");
  CHECK(rs[1].ok());
}
