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

TEST_CASE("docs/environment.md documents every setting") {
  std::ifstream f(TRN_SOURCE_DIR "/docs/environment.md");
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  std::string readme = ss.str();
  for (const auto& s : settings::all()) {
    INFO(s.name);
    CHECK(readme.find(std::string("`") + s.name + "`") != std::string::npos);
  }
}

// Every numeric and boolean setting says what it takes, and a value outside that is one usage
// error naming the variable and the value, from the getter and from validate() alike.
TEST_CASE("numeric and boolean settings reject nonsense in one place") {
  const std::vector<std::pair<const char*, const char*>> bad = {
      {"TRN_TIMEOUT", "0"},           {"TRN_TIMEOUT", "-5"},          {"TRN_TIMEOUT", "soon"},
      {"TRN_TIMEOUT", "nan"},         {"TRN_TIMEOUT", "inf"},         {"TRN_TIMEOUT", "1e300"},
      {"TRN_HEARTBEAT_INTERVAL", "0"}, {"TRN_FABRIC_SPIN_US", "-1"},  {"TRN_FABRIC_YIELD_US", "x"},
      {"TRN_FABRIC_RING_EAGER", "-1"}, {"TRN_FABRIC_RING_EAGER", "2000000"}, {"TRN_FABRIC_RING", "2"},
      {"TRN_FABRIC_PULL", "maybe"},   {"TRN_FABRIC_SHM", "yes please"}, {"TRN_COLL_POLL_US", "-3"},
      {"TRN_CHECK_COLLECTIVES", "x"}, {"TRN_RANK", "-1"},             {"TRN_WORLD_SIZE", "0"},
      {"TRN_LOCAL_RANK", "1.5"},      {"TRN_LOCAL_WORLD_SIZE", "0"},  {"TRN_NODE_RANK", "-2"},
      {"TRN_GENERATION", "-1"},       {"TRN_THREADS", "0"},           {"TRN_RANK", "99999999999999999999"},
      {"TRN_ALGO", "fastest"},        {"TRN_FABRIC_PROVIDER", "carrier-pigeon"}, {"TRN_LOG_LEVEL", "loud"},
  };
  for (const auto& [name, value] : bad) {
    INFO(name << "=" << value);
    setenv(name, value, 1);
    settings::reload_for_testing();
    try {
      settings::validate();
      FAIL("validate() accepted it");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::kUsage);
      CHECK_THAT(e.what(), Catch::Contains(std::string(name) + "=" + value + " is not valid: use "));
      CHECK(std::string(e.what()).find('\n') == std::string::npos);
    }
    unsetenv(name);
  }
  setenv("TRN_TIMEOUT", "0", 1);
  settings::reload_for_testing();
  CHECK_THROWS_WITH(settings::get_seconds("TRN_TIMEOUT"),
                    "TRN_TIMEOUT=0 is not valid: use a number of seconds greater than 0 and at most 10000000 "
                    "(default 300)");
  unsetenv("TRN_TIMEOUT");
  const std::vector<std::pair<const char*, const char*>> good = {
      {"TRN_TIMEOUT", "0.5"}, {"TRN_FABRIC_SPIN_US", "0"}, {"TRN_FABRIC_RING_EAGER", "1048576"},
      {"TRN_FABRIC_RING", "off"}, {"TRN_FABRIC_SHM", ""}, {"TRN_RANK", "0"}, {"TRN_ALGO", "rhd"},
      {"TRN_LOG_LEVEL", "warning"}, {"TRN_THREADS", "4"}, {"TRN_FABRIC_IFACE", "anything"}};
  for (const auto& [name, value] : good) setenv(name, value, 1);
  settings::reload_for_testing();
  CHECK_NOTHROW(settings::validate());
  CHECK(settings::get_seconds("TRN_TIMEOUT") == std::chrono::milliseconds(500));
  for (const auto& [name, value] : good) unsetenv(name);
  settings::reload_for_testing();
}
