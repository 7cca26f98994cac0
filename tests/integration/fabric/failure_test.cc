// Failures: a peer killed mid-transfer, abort() from another thread, bad provider choices.
#include <signal.h>

#include <thread>

#include "collectives/core/log.h"
#include "tests/integration/fabric/world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<PointToPoint> connect_world(const WorldArgs& w) {
  log::set_rank(w.rank);
  FileStore store(w.dir);
  fabric::Options o = fabric::Options::from_environment();
  o.connect_timeout = 30s;  // tests shorten TRN_TIMEOUT for the waits under test, not for start-up
  return fabric::connect(store, w.rank, w.size, o);
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// Rank 0 receives a stream of 16 messages of 4 MiB from the last rank, which sends four of
// them, starts a fifth and SIGKILLs itself. Rank 0's wait must fail by its deadline (TRN_TIMEOUT)
// or earlier, naming the dead rank; the ranks in between just finish.
TRN_TEST_CHILD(killed_peer) {
  return run_main("fabric-test", [&] {
    WorldArgs w = parse_world(args);
    auto p = connect_world(w);
    const int victim = w.size - 1, kCount = 16;
    const size_t len = 4u << 20;
    std::vector<char> buf(len * kCount, 'x');
    char go = 'g';
    if (w.rank == 0) {
      std::vector<RequestPtr> rs;
      for (int i = 0; i < kCount; ++i) rs.push_back(p->irecv(victim, 100 + i, buf.data() + i * len, len));
      p->isend(victim, 6, &go, 1)->wait(Deadline::from_default_timeout());
      auto start = Clock::now();
      int done = 0;
      try {
        for (auto& r : rs) {
          r->wait(Deadline::from_default_timeout());
          ++done;
        }
      } catch (const Error& e) {
        double s = std::chrono::duration<double>(Clock::now() - start).count();
        std::printf("after %d messages and %.1f s: %s\n", done, s, e.what());
        bool named = contains(e.what(), fmt::format("rank {}", victim)) && contains(e.what(), "host");
        return named && done >= 4 && (e.kind() == ErrorKind::kTimeout || e.kind() == ErrorKind::kRemote) ? 0 : 3;
      }
      std::printf("every receive from a killed rank completed\n");
      return 4;
    }
    if (w.rank == victim) {
      p->irecv(0, 6, &go, 1)->wait(Deadline::from_default_timeout());
      for (int i = 0; i < 4; ++i) p->isend(0, 100 + i, buf.data() + i * len, len)->wait(Deadline::from_default_timeout());
      auto s = p->isend(0, 104, buf.data() + 4 * len, len);
      p->progress();
      raise(w.extra.at(0) == "stop" ? SIGSTOP : SIGKILL);  // stopped: the harness kills it later
    }
    return 0;
  });
}

TEST_CASE("a peer killed mid-transfer fails the survivor's receive, naming it", "[integration]") {
  for (auto env : provider_envs()) {
    env.emplace("TRN_TIMEOUT", "5");
    for (int n : {2, 3}) {
      INFO(env_name(env) << " ranks " << n);
      auto rs = run_world("killed_peer", n, env, {"kill"}, 40s);
      INFO(rs[0].describe());
      CHECK(rs[0].ok());
      CHECK(contains(rs[0].output, fmt::format("rank {}", n - 1)));
      CHECK(rs[n - 1].signal == SIGKILL);
      for (int r = 1; r < n - 1; ++r) CHECK(rs[r].ok());
    }
  }
}

TEST_CASE("a peer that stops answering fails the survivor's wait by the deadline", "[integration]") {
  for (auto env : provider_envs()) {
    env.emplace("TRN_TIMEOUT", "3");
    env.emplace("TRN_LOG_LEVEL", "warn");
    INFO(env_name(env));
    TempDir dir;
    Process survivor(child("killed_peer", {"0", "2", dir.path(), "stop"}, env));
    Process stopped(child("killed_peer", {"1", "2", dir.path(), "stop"}, env));
    ProcResult r0 = survivor.wait(std::chrono::steady_clock::now() + 20s);
    stopped.signal_group(SIGKILL);
    stopped.wait(std::chrono::steady_clock::now() + 5s);
    INFO(r0.describe());
    CHECK(r0.ok());
    CHECK(contains(r0.output, "did not complete by its deadline"));
    CHECK(contains(r0.output, "receive from rank 1 (host "));
  }
}

// Rank 0 waits for a message nobody sends; another thread aborts. The wait must end with an
// aborted error carrying the reason, and later posts must fail the same way.
TRN_TEST_CHILD(abort_unblocks) {
  return run_main("fabric-test", [&] {
    WorldArgs w = parse_world(args);
    auto p = connect_world(w);
    if (w.rank != 0) {
      std::this_thread::sleep_for(500ms);
      return 0;
    }
    char buf[8];
    auto r = p->irecv(1, 3, buf, sizeof(buf));
    std::thread aborter([&] {
      std::this_thread::sleep_for(300ms);
      p->abort("test abort from another thread");
    });
    int rc = 5;
    try {
      r->wait(Deadline::after(60s));
      std::printf("wait returned without a message\n");
    } catch (const Error& e) {
      std::printf("wait: %s\n", e.what());
      rc = e.kind() == ErrorKind::kAborted && contains(e.what(), "test abort") ? 0 : 6;
    }
    aborter.join();
    if (!p->aborted()) rc = 7;
    try {
      p->isend(1, 4, buf, 1);
      rc = 8;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kAborted) rc = 9;
    }
    try {
      r->test();
      rc = 10;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kAborted) rc = 11;
    }
    return rc;
  });
}

TEST_CASE("abort() from another thread unblocks a waiting receive", "[integration]") {
  for (const auto& env : provider_envs()) {
    INFO(env_name(env));
    auto rs = run_world("abort_unblocks", 2, env);
    require_all_ok(rs);
    CHECK(contains(rs[0].output, "test abort from another thread"));
  }
}

TRN_TEST_CHILD(connect_alone) {
  return run_main("fabric-test", [&] {
    WorldArgs w = parse_world(args);
    auto p = connect_world(w);
    std::printf("connected: %s\n", p->describe().c_str());
    return 0;
  });
}

TEST_CASE("a provider that is absent or unknown is a usage error listing what is present",
          "[integration]") {
  auto efa = run_world("connect_alone", 1, {{"TRN_FABRIC_PROVIDER", "efa"}});
  INFO(efa[0].describe());
  CHECK(efa[0].exit_code == 2);
  CHECK(contains(efa[0].output, "TRN_FABRIC_PROVIDER=efa"));
  CHECK(contains(efa[0].output, "available:"));
  CHECK(contains(efa[0].output, "tcp;ofi_rxm"));
  auto bogus = run_world("connect_alone", 1, {{"TRN_FABRIC_PROVIDER", "carrier-pigeon"}});
  INFO(bogus[0].describe());
  CHECK(bogus[0].exit_code == 2);
  CHECK(contains(bogus[0].output, "TRN_FABRIC_PROVIDER=carrier-pigeon is not valid: use one of auto|efa|tcp|udp|shm|sockets"));
}

TEST_CASE("auto without EFA falls back to tcp with a warning", "[integration]") {
  auto rs = run_world("connect_alone", 2, {{"TRN_FABRIC_PROVIDER", "auto"}, {"TRN_FABRIC_SHM", "0"}});
  require_all_ok(rs);
  CHECK(contains(rs[0].output, "NO EFA DEVICE FOUND"));
  CHECK(contains(rs[0].output, "connected: rank 0/2 tcp;ofi_rxm"));
}

TEST_CASE("TRN_FABRIC_IFACE picks the tcp interface; an unknown one is a usage error listing them",
          "[integration]") {
  auto lo = run_world("connect_alone", 2, {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}, {"TRN_FABRIC_IFACE", "lo"}});
  require_all_ok(lo);
  CHECK(contains(lo[0].output, "tcp;ofi_rxm on lo"));
  // Whatever the provider choice: the interface is named as the problem, not the provider.
  for (const char* provider : {"tcp", "auto", "sockets"}) {
    auto bad = run_world("connect_alone", 1, {{"TRN_FABRIC_PROVIDER", provider}, {"TRN_FABRIC_IFACE", "nosuch0"}});
    INFO(provider << ": " << bad[0].describe());
    CHECK(bad[0].exit_code == 2);
    CHECK(contains(bad[0].output, "fabric-test: error: TRN_FABRIC_IFACE=nosuch0: no network interface nosuch0 on "
                                  "this host (interfaces: lo"));
    CHECK_FALSE(contains(bad[0].output, "neither efa nor"));
  }
  auto addr = run_world("connect_alone", 1, {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_IFACE", "192.0.2.77"}});
  INFO(addr[0].describe());
  CHECK(addr[0].exit_code == 2);
  CHECK(contains(addr[0].output, "TRN_FABRIC_IFACE=192.0.2.77: no interface of this host has that address"));
  auto by_addr = run_world("connect_alone", 2, {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"},
                                                {"TRN_FABRIC_IFACE", "127.0.0.1"}});
  require_all_ok(by_addr);
}

TEST_CASE("a TRN_* setting out of range is one usage error before anything starts", "[integration]") {
  for (const char* timeout : {"0", "-1", "abc"}) {
    auto rs = run_world("connect_alone", 1, {{"TRN_TIMEOUT", timeout}});
    INFO(rs[0].describe());
    CHECK(rs[0].exit_code == 2);
    CHECK(contains(rs[0].output, fmt::format("fabric-test: error: TRN_TIMEOUT={} is not valid: use a number of "
                                             "seconds greater than 0", timeout)));
  }
}
