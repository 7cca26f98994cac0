#include <catch2/catch.hpp>

#include "collectives/core/error.h"
#include "collectives/core/main.h"
#include "tests/support/process.h"

using namespace trn;

TRN_TEST_CHILD(throws) {
  return run_main("trn-example", [&]() -> int {
    if (args.at(0) == "usage") throw usage_error("--steps must be positive; got -3");
    if (args.at(0) == "remote") throw remote_error("rank 3 (host:1234) closed the connection");
    if (args.at(0) == "bug") throw std::logic_error("vector index out of range");
    return 0;
  });
}

TEST_CASE("a usage error prints one line and exits 2") {
  auto r = test::run_all({test::child("throws", {"usage"})}, std::chrono::seconds(30)).at(0);
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK(r.output == "trn-example: error: --steps must be positive; got -3\n");
}

TEST_CASE("a peer failure and a bug are told apart and exit 1") {
  auto rs = test::run_all({test::child("throws", {"remote"}), test::child("throws", {"bug"})},
                          std::chrono::seconds(30));
  CHECK(rs[0].exit_code == 1);
  CHECK(rs[0].output == "trn-example: remote error: rank 3 (host:1234) closed the connection\n");
  CHECK(rs[1].exit_code == 1);
  CHECK_THAT(rs[1].output, Catch::Contains("internal error"));
  CHECK_THAT(rs[1].output, Catch::Contains("vector index out of range"));
}

TEST_CASE("with_context keeps the kind and prefixes the message") {
  Error e = remote_error("peer 2 died").with_context("all-reduce #7");
  CHECK(e.kind() == ErrorKind::kRemote);
  CHECK(std::string(e.what()) == "all-reduce #7: peer 2 died");
}

TEST_CASE("an error naming input with line breaks or control bytes stays one line") {
  const Error e = usage_error("the pattern '{}' does not compile", std::string("[\\r[\n]*\t\x01\x7f\xc3\xa9"));
  CHECK(std::string(e.what()) == "the pattern '[\\r[\\n]*\\t\\x01\\x7f\xc3\xa9' does not compile");
  CHECK(std::string(e.with_context("tokenizer t.json\r").what()) ==
        "tokenizer t.json\\r: the pattern '[\\r[\\n]*\\t\\x01\\x7f\xc3\xa9' does not compile");
}
