// Worker programs for the trnrun integration tests (TRN_TEST_CHILDs of the test executable) and
// helpers to read what they print.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace trn::test::launch {

// argv for `trnrun OPTIONS -- <this exe> --trn-child CHILD ARGS`.
std::vector<std::string> trnrun_argv(const std::vector<std::string>& options, const std::string& child,
                                     const std::vector<std::string>& args = {});

// Lines "[rank R] KEY=VALUE KEY=VALUE ..." printed by the env_report child, by rank.
std::map<int, std::map<std::string, std::string>> env_reports(const std::string& output);

// Numbers following "KEY=" anywhere in output (e.g. every "pid=123").
std::vector<pid_t> numbers_after(const std::string& output, const std::string& key);

// A standalone trn-coordinator on a free loopback port (killed with the object).
struct Coordinator {
  Coordinator();
  TempDir dir;
  std::unique_ptr<Process> process;
  std::string address;  // 127.0.0.1:PORT
};

// True when pid no longer exists (or is a zombie nobody reaped yet).
bool gone(pid_t pid);

}  // namespace trn::test::launch
