// main() of every Catch2 test executable: runs a TRN_TEST_CHILD when asked to, else Catch2.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "tests/support/process.h"

int main(int argc, char** argv) {
  int code = 0;
  if (trn::test::maybe_run_child(argc, argv, &code)) return code;
  return Catch::Session().run(argc, argv);
}
