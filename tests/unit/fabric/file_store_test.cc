#include <catch2/catch.hpp>
#include <dirent.h>

#include <thread>

#include "collectives/bootstrap/file_store.h"
#include "collectives/core/error.h"
#include "collectives/core/settings.h"
#include "tests/support/process.h"

using namespace trn;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d))
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
  closedir(d);
  return names;
}

}  // namespace

TEST_CASE("FileStore: set then get returns the value, set overwrites, odd keys work") {
  test::TempDir dir;
  FileStore s(dir.path() + "/nested/store");
  s.set("fabric/g0/addr/3", "hello");
  CHECK(s.get("fabric/g0/addr/3", Deadline::after(1s)) == "hello");
  s.set("fabric/g0/addr/3", std::string("bin\0ary", 7));
  CHECK(s.get("fabric/g0/addr/3", Deadline::after(1s)) == std::string("bin\0ary", 7));
  for (std::string key : {".hidden", "a b/c%d", "..", "x.y", ""}) {
    s.set(key, "v:" + key);
    CHECK(s.get(key, Deadline::after(1s)) == "v:" + key);
  }
  // Distinct keys never share a file.
  CHECK(s.get("x.y", Deadline::after(1s)) != s.get("..", Deadline::after(1s)));
  for (const auto& name : list_dir(s.dir())) CHECK(name.rfind(".tmp.", 0) != 0);  // no temp files left
}

TEST_CASE("FileStore: get waits for a later set and times out naming the key") {
  test::TempDir dir;
  FileStore s(dir.path());
  std::thread writer([&] {
    std::this_thread::sleep_for(50ms);
    FileStore(dir.path()).set("late", "here");
  });
  CHECK(s.get("late", Deadline::after(10s)) == "here");
  writer.join();
  try {
    s.get("never", Deadline::after(100ms));
    FAIL("get of a key nobody sets returned");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kTimeout);
    CHECK(std::string(e.what()).find("'never'") != std::string::npos);
  }
}

TEST_CASE("FileStore: add starts from 0 and rejects a non-integer value") {
  test::TempDir dir;
  FileStore s(dir.path());
  CHECK(s.add("n", 5) == 5);
  CHECK(s.add("n", -2) == 3);
  CHECK(s.get("n", Deadline::after(1s)) == "3");
  s.set("word", "abc");
  CHECK_THROWS_AS(s.add("word", 1), Error);
}

TRN_TEST_CHILD(store_adder) {
  FileStore s(args.at(0));
  for (int i = 0; i < 100; ++i) s.add("counter", 1);
  s.set("done/" + args.at(1), "1");
  return 0;
}

TEST_CASE("FileStore: concurrent add from four processes loses no update") {
  test::TempDir dir;
  std::vector<test::ProcSpec> specs;
  for (int i = 0; i < 4; ++i) specs.push_back(test::child("store_adder", {dir.path(), std::to_string(i)}));
  for (const auto& r : test::run_all(specs, 60s)) {
    INFO(r.describe());
    CHECK(r.ok());
  }
  FileStore s(dir.path());
  CHECK(s.get("counter", Deadline::after(1s)) == "400");
  CHECK(s.add("counter", 0) == 400);
}

TEST_CASE("FileStore: an unset TRN_STORE_DIR is a usage error") {
  unsetenv("TRN_STORE_DIR");
  settings::reload_for_testing();
  try {
    FileStore::from_environment();
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK(std::string(e.what()).find("TRN_STORE_DIR") != std::string::npos);
  }
}
