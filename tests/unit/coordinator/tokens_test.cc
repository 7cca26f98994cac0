// Job tokens as a pure function of (admin token, job id, nonce), and the random nonces.
#include "launcher/server/tokens.h"

#include <catch2/catch.hpp>
#include <regex>
#include <set>

using namespace trn::control;

TEST_CASE("a job token is HMAC-SHA256 of the job id and nonce under the admin token, as 64 hex digits") {
  const std::string t = derive_job_token("admin", "job", "00ff");
  CHECK(std::regex_match(t, std::regex("[0-9a-f]{64}")));
  CHECK(derive_job_token("admin", "job", "00ff") == t);  // a restart or another replica derives the same
  CHECK(derive_job_token("admin2", "job", "00ff") != t);
  CHECK(derive_job_token("admin", "job2", "00ff") != t);
  CHECK(derive_job_token("admin", "job", "00fe") != t);
  // The fields are separated: moving bytes between job id and nonce gives another token.
  CHECK(derive_job_token("admin", "jo", "b00ff") != t);
  // A known answer: Python's hmac.new(b"admin", b"trn job token v1\0job\000ff", sha256).
  CHECK(t == "d177c4ca9ce82284a8c3d650ada7d7c77d4bad2dfa4c8488a058524161df9893");
}

TEST_CASE("nonces are random hex of the asked length; token digests are SHA-256") {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string n = random_hex(32);
    CHECK(std::regex_match(n, std::regex("[0-9a-f]{64}")));
    seen.insert(n);
  }
  CHECK(seen.size() == 100);
  CHECK(token_digest("abc").size() == 32);
  CHECK(token_digest("abc") != token_digest("abd"));
}
