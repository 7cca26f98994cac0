#include <catch2/catch.hpp>
#include <stdlib.h>

#include <fstream>
#include <sstream>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

using namespace trn;

TEST_CASE("settings fall back to their registered defaults") {
  unsetenv("TRN_TIMEOUT");
  settings::reload_for_testing();
  CHECK(settings::get("TRN_TIMEOUT") == "300");
  CHECK(settings::get_seconds("TRN_TIMEOUT") == std::chrono::seconds(300));
  CHECK_FALSE(settings::is_set("TRN_TIMEOUT"));
}

TEST_CASE("settings are read from the environment once") {
  setenv("TRN_TIMEOUT", "2.5", 1);
  settings::reload_for_testing();
  CHECK(settings::get_double("TRN_TIMEOUT") == 2.5);
  setenv("TRN_TIMEOUT", "7", 1);  // later changes are not seen: values are read once
  CHECK(settings::get_double("TRN_TIMEOUT") == 2.5);
  unsetenv("TRN_TIMEOUT");
  settings::reload_for_testing();
}

TEST_CASE("a malformed setting is a usage error naming the variable") {
  setenv("TRN_CHECK_COLLECTIVES", "maybe", 1);
  settings::reload_for_testing();
  try {
    settings::get_bool("TRN_CHECK_COLLECTIVES");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("TRN_CHECK_COLLECTIVES=maybe"));
  }
  unsetenv("TRN_CHECK_COLLECTIVES");
  settings::reload_for_testing();
}

TEST_CASE("an unregistered setting is an internal error") {
  try {
    settings::get("TRN_NO_SUCH_SETTING");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kInternal);
  }
}

TEST_CASE("the README documents every setting") {
  std::ifstream f(TRN_SOURCE_DIR "/README.md");
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  std::string readme = ss.str();
  for (const auto& s : settings::all()) {
    INFO(s.name);
    CHECK(readme.find(std::string("`") + s.name + "`") != std::string::npos);
  }
}
