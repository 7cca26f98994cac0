// Same-host shared memory in odd environments: a /dev/shm too small to use, and what killed
// ranks left in /dev/shm.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "tests/integration/fabric/world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TRN_TEST_CHILD(connect_pair) {
  return run_main("fabric-test", [&] {
    WorldArgs w = parse_world(args);
    FileStore store(w.dir);
    auto p = fabric::connect(store, w.rank, w.size);
    std::printf("connected: %s\n", p->describe().c_str());
    return 0;
  });
}

// A pid no process has now: a child that already exited (and was reaped).
pid_t dead_pid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  waitpid(pid, nullptr, 0);
  return pid;
}

}  // namespace

TEST_CASE("a /dev/shm too small for shared memory is a warning naming what it takes", "[integration]") {
  if (geteuid() != 0) {
    WARN("skipped: mounting a small tmpfs on /dev/shm in a private mount namespace needs root");
    return;
  }
  TempDir dir;
  std::vector<ProcSpec> specs;
  for (int r = 0; r < 2; ++r) {
    specs.push_back({{"unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec \"$0\" \"$@\"",
                      self_exe(), "--trn-child", "connect_pair", std::to_string(r), "2", dir.path()},
                     {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_LOG_LEVEL", "warn"}}});
  }
  auto rs = run_all(specs, 60s);
  require_all_ok(rs);
  INFO(rs[0].output);
  CHECK(contains(rs[0].output, "shared memory is unavailable"));
  CHECK(contains(rs[0].output, "of /dev/shm"));
  CHECK(contains(rs[0].output, "MiB free"));
  CHECK(contains(rs[0].output, "TRN_FABRIC_RING=0"));
  CHECK(contains(rs[0].output, "TRN_FABRIC_SHM=0"));
  CHECK_FALSE(contains(rs[1].output, "shared memory is unavailable"));  // once per host
}

TEST_CASE("what dead ranks left in /dev/shm is removed by the next rank that uses it", "[integration]") {
  const pid_t dead = dead_pid();
  const std::vector<std::string> stale = {fmt::format("trn_{}_abc_0", dead), fmt::format("trn-ring.{}.deadbeef", dead)};
  const std::string live = fmt::format("trn-ring.{}.cafe", getpid());  // this process lives: kept
  for (const auto& name : std::vector<std::string>{stale[0], stale[1], live}) {
    const int fd = shm_open(("/" + name).c_str(), O_CREAT | O_RDWR, 0600);
    REQUIRE(fd >= 0);
    close(fd);
  }
  auto rs = run_world("connect_pair", 2, {{"TRN_FABRIC_PROVIDER", "shm"}});
  require_all_ok(rs);
  for (const auto& name : stale) {
    INFO(name);
    CHECK_FALSE(std::filesystem::exists("/dev/shm/" + name));
  }
  CHECK(std::filesystem::exists("/dev/shm/" + live));
  shm_unlink(("/" + live).c_str());
}
