// The etcd client (launcher/server/etcd.h) against real etcd processes: one member for the
// key-value, transaction and lease contracts, three for failover and the loss of quorum.
#include "launcher/server/etcd.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <thread>

#include "collectives/core/error.h"
#include "tests/integration/etcd/etcd_cluster.h"

using namespace std::chrono_literals;
using trn::control::Code;
using trn::control::etcd::EtcdClient;
using trn::control::etcd::LeaseKeeper;
using trn::control::etcd::Options;
using trn::control::etcd::parse_endpoints;
using trn::control::etcd::Write;
using Clock = std::chrono::steady_clock;

namespace {

// Polls cond every 50 ms until it holds or `within` passes; true if it held.
template <typename F>
bool eventually(F cond, Clock::duration within) {
  auto deadline = Clock::now() + within;
  while (Clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(50ms);
  }
  return cond();
}

const std::string& message(const trn::control::Status& s) { return s.message; }
template <typename T>
const std::string& message(const trn::control::etcd::Result<T>& r) {
  return r.status.message;
}
// REQUIRE(x.ok()), showing the failure's message.
#define REQUIRE_OK(x)  \
  do {                 \
    auto&& r_ = (x);   \
    INFO(message(r_)); \
    REQUIRE(r_.ok());  \
  } while (0)

bool present(EtcdClient& c, const std::string& key) {
  auto r = c.get(key);
  REQUIRE_OK(r);
  return r.value.has_value();
}

}  // namespace

TEST_CASE("an etcd:// URL is parsed into endpoints, and a malformed one is a one-line usage error") {
  CHECK(parse_endpoints("etcd://127.0.0.1:2379") == std::vector<std::string>{"127.0.0.1:2379"});
  CHECK(parse_endpoints("etcd://a:1,b.example:2,[::1]:3") ==
        std::vector<std::string>{"a:1", "b.example:2", "[::1]:3"});
  for (const char* bad :
       {"", "http://a:1", "etcd://", "etcd://a", "etcd://a:", "etcd://a:x", "etcd://a:70000", "etcd://:1",
        "etcd://a:1,", "etcd://a:1,,b:2", "etcd://::1:2", "etcd://a:1/x"}) {
    INFO(bad);
    try {
      parse_endpoints(bad);
      FAIL("accepted");
    } catch (const trn::Error& e) {
      CHECK(e.kind() == trn::ErrorKind::kUsage);
      CHECK_THAT(e.what(), Catch::Contains("malformed etcd URL") && Catch::Contains("etcd://HOST:PORT"));
      CHECK(std::string(e.what()).find('\n') == std::string::npos);
    }
  }
}

TEST_CASE("put get range_prefix and delete round trip, with a 1 MiB value and 2000 keys in pages") {
  trn::test::EtcdCluster etcd(1);
  etcd.start();
  Options o;
  o.page_size = 300;  // 2,000 keys take 7 pages
  EtcdClient c(parse_endpoints(etcd.endpoints()), o);

  auto missing = c.get("/a");
  REQUIRE_OK(missing);
  CHECK(!missing.value);

  REQUIRE_OK(c.put("/a", "1"));
  auto a1 = c.get("/a");
  REQUIRE_OK(a1);
  REQUIRE(a1.value);
  CHECK(a1.value->value == "1");
  CHECK(a1.value->create_revision > 0);
  CHECK(a1.value->mod_revision == a1.value->create_revision);
  REQUIRE_OK(c.put("/a", "2"));
  auto a2 = c.get("/a");
  REQUIRE(a2.value);
  CHECK(a2.value->value == "2");
  CHECK(a2.value->create_revision == a1.value->create_revision);
  CHECK(a2.value->mod_revision > a1.value->mod_revision);

  // Binary-safe and large: a 1 MiB value of every byte.
  std::string big(1 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 7 + i / 255);
  REQUIRE_OK(c.put("/big", big));
  auto b = c.get("/big");
  REQUIRE(b.value);
  CHECK(b.value->value == big);

  // 2,000 keys under /p/, written from 8 threads (the client is shared), plus neighbours that
  // must not be listed.
  const int kKeys = 2000;
  std::vector<std::thread> writers;
  std::atomic<int> failed{0};
  for (int t = 0; t < 8; ++t)
    writers.emplace_back([&, t] {
      for (int k = t; k < kKeys; k += 8)
        if (!c.put(fmt::format("/p/{:05}", k), fmt::format("v{}", k)).ok()) ++failed;
    });
  for (auto& w : writers) w.join();
  REQUIRE(failed == 0);
  REQUIRE_OK(c.put("/p", "not under /p/"));
  REQUIRE_OK(c.put("/p0", "not under /p/"));
  auto all = c.range_prefix("/p/");
  REQUIRE_OK(all);
  REQUIRE(all.value.size() == kKeys);
  for (int k = 0; k < kKeys; ++k) {
    CHECK(all.value[static_cast<size_t>(k)].key == fmt::format("/p/{:05}", k));
    CHECK(all.value[static_cast<size_t>(k)].value == fmt::format("v{}", k));
  }
  auto everything = c.range_prefix("");
  REQUIRE_OK(everything);
  CHECK(everything.value.size() == kKeys + 4);  // /a /big /p /p0

  auto d = c.delete_key("/a");
  REQUIRE_OK(d);
  CHECK(d.value == 1);
  CHECK(c.delete_key("/a").value == 0);
  CHECK(!present(c, "/a"));
  auto dp = c.delete_prefix("/p/");
  REQUIRE_OK(dp);
  CHECK(dp.value == kKeys);
  CHECK(c.range_prefix("/p/").value.empty());
  CHECK(present(c, "/p"));
  CHECK(present(c, "/p0"));
}

TEST_CASE("create_if_absent under a lease: the first caller creates and after revoke the next one can") {
  trn::test::EtcdCluster etcd(1);
  etcd.start();
  EtcdClient c(parse_endpoints(etcd.endpoints()));
  auto l1 = c.grant(30), l2 = c.grant(30);
  REQUIRE_OK(l1);
  REQUIRE_OK(l2);
  CHECK(l1.value.ttl_s == 30);
  CHECK(l1.value.id != l2.value.id);

  auto first = c.create_if_absent("/leader", "a", l1.value.id);
  REQUIRE_OK(first);
  CHECK(first.value.created);
  CHECK(first.value.current.value == "a");
  CHECK(first.value.current.lease == l1.value.id);

  auto second = c.create_if_absent("/leader", "b", l2.value.id);
  REQUIRE_OK(second);
  CHECK(!second.value.created);
  CHECK(second.value.current.value == "a");
  CHECK(second.value.current.lease == l1.value.id);
  CHECK(second.value.current.create_revision == first.value.current.create_revision);

  // Our own key, seen again (a retry after an ambiguous failure), counts as created.
  auto again = c.create_if_absent("/leader", "a", l1.value.id);
  REQUIRE_OK(again);
  CHECK(again.value.created);

  REQUIRE_OK(c.revoke(l1.value.id));
  CHECK(!present(c, "/leader"));
  auto revoked = c.revoke(l1.value.id);
  CHECK(revoked.code == Code::kNotFound);
  CHECK_THAT(revoked.message, Catch::Contains("lease not found"));
  auto put_dead = c.put("/x", "y", l1.value.id);
  CHECK(put_dead.code == Code::kNotFound);

  auto third = c.create_if_absent("/leader", "b", l2.value.id);
  REQUIRE_OK(third);
  CHECK(third.value.created);
  CHECK(third.value.current.create_revision > first.value.current.create_revision);
  auto now = c.get("/leader");
  REQUIRE(now.value);
  CHECK(now.value->value == "b");
  CHECK(now.value->lease == l2.value.id);
  CHECK(now.value->create_revision == third.value.current.create_revision);
}

TEST_CASE("a lease kept by LeaseKeeper outlives 3 TTLs and expires once the keeper is gone") {
  trn::test::EtcdCluster etcd(1);
  etcd.start();
  EtcdClient c(parse_endpoints(etcd.endpoints()));

  // etcd raises a TTL below its minimum (1.5 election timeouts, whole seconds: 1 s here).
  auto tiny = c.grant(0);
  REQUIRE_OK(tiny);
  CHECK(tiny.value.ttl_s >= 1);

  auto lease = c.grant(2);
  REQUIRE_OK(lease);
  const auto ttl = std::chrono::seconds(lease.value.ttl_s);
  REQUIRE_OK(c.put("/alive", "x", lease.value.id));
  std::atomic<int> lost_calls{0};
  {
    LeaseKeeper keeper(c, lease.value, [&](const std::string&) { ++lost_calls; });
    std::this_thread::sleep_for(3 * ttl + 500ms);
    CHECK(!keeper.lost());
    CHECK(keeper.lost_reason().empty());
    CHECK(present(c, "/alive"));
  }
  auto stopped = Clock::now();
  CHECK(eventually([&] { return !present(c, "/alive"); }, ttl + 1s));
  INFO("gone after " << std::chrono::duration<double>(Clock::now() - stopped).count() << " s");
  CHECK(lost_calls == 0);

  // A keeper of a lease that no longer exists reports it lost.
  auto gone = c.grant(5);
  REQUIRE_OK(gone);
  REQUIRE_OK(c.revoke(gone.value.id));
  std::string why;
  LeaseKeeper dead(c, gone.value, [&](const std::string& r) { why = r; });
  REQUIRE(eventually([&] { return dead.lost(); }, 5s));
  CHECK_THAT(dead.lost_reason(), Catch::Contains("expired or was revoked"));
  CHECK(why == dead.lost_reason());
}

TEST_CASE("against a hung etcd a call ends at its deadline and a LeaseKeeper stops at once") {
  trn::test::EtcdCluster etcd(1);
  etcd.start();
  Options o;
  o.timeout = 1s;
  EtcdClient c(parse_endpoints(etcd.endpoints()), o);
  Options slow_options;
  slow_options.timeout = 10s;
  EtcdClient slow(parse_endpoints(etcd.endpoints()), slow_options);
  auto lease = c.grant(9);
  REQUIRE_OK(lease);
  REQUIRE_OK(slow.get("/warm"));  // connected before the member hangs
  auto keeper = std::make_unique<LeaseKeeper>(slow, lease.value);
  std::this_thread::sleep_for(500ms);  // its first refresh is done; the next is due at TTL/3
  etcd.pause(0);

  auto t0 = Clock::now();
  auto s = c.put("/k", "v");
  auto took = Clock::now() - t0;
  INFO(s.message);
  CHECK(s.code == Code::kDeadlineExceeded);
  CHECK_THAT(s.message, Catch::Contains("no answer within 1.0 s") &&
                            Catch::Contains("the write may or may not have taken effect"));
  CHECK(took < o.timeout + 1s);

  // The keeper's second refresh (due 3 s after its first) is now blocked, for up to 5 s more
  // (until its lease would expire): destroying the keeper cancels it.
  std::this_thread::sleep_for(2500ms);
  CHECK(!keeper->lost());
  t0 = Clock::now();
  keeper.reset();
  CHECK(Clock::now() - t0 < 2s);
  etcd.resume(0);
  REQUIRE_OK(c.put("/k", "v"));
}

TEST_CASE("txn_put_if writes only while the guard key has the given create_revision") {
  trn::test::EtcdCluster etcd(1);
  etcd.start();
  EtcdClient c(parse_endpoints(etcd.endpoints()));
  REQUIRE_OK(c.put("/state/b", "old"));
  auto created = c.create_if_absent("/leader", "me", 0);
  REQUIRE_OK(created);
  REQUIRE(created.value.created);
  const int64_t rev1 = created.value.current.create_revision;

  auto ok = c.txn_put_if("/leader", rev1, {Write::put("/state/a", "1"), Write::remove("/state/b")});
  REQUIRE_OK(ok);
  CHECK(ok.value);
  CHECK(c.get("/state/a").value->value == "1");
  CHECK(!present(c, "/state/b"));

  // The guard key is deleted and re-created (another leader): the old revision is stale.
  REQUIRE_OK(c.delete_key("/leader"));
  auto recreated = c.create_if_absent("/leader", "other", 0);
  REQUIRE(recreated.value.created);
  const int64_t rev2 = recreated.value.current.create_revision;
  CHECK(rev2 != rev1);
  auto stale = c.txn_put_if("/leader", rev1, {Write::put("/state/a", "2")});
  REQUIRE_OK(stale);
  CHECK(!stale.value);
  CHECK(c.get("/state/a").value->value == "1");
  auto fresh = c.txn_put_if("/leader", rev2, {Write::put("/state/a", "3")});
  REQUIRE_OK(fresh);
  CHECK(fresh.value);
  CHECK(c.get("/state/a").value->value == "3");

  // An absent guard fails too.
  REQUIRE_OK(c.delete_key("/leader"));
  auto absent = c.txn_put_if("/leader", rev2, {Write::put("/state/a", "4")});
  REQUIRE_OK(absent);
  CHECK(!absent.value);

  // etcd refuses the same key twice in one transaction: a usage error, not a failed guard.
  auto twice = c.txn_put_if("/state/a", c.get("/state/a").value->create_revision,
                            {Write::put("/state/x", "1"), Write::put("/state/x", "2")});
  CHECK(twice.status.code == Code::kInvalidArgument);
}

TEST_CASE("the client survives one of three members and fails within its deadline without quorum") {
  trn::test::EtcdCluster etcd(3);
  etcd.start();
  // The client starts at a follower, so killing it makes the client move to another member
  // while the cluster keeps its leader.
  int leader = etcd.leader();
  REQUIRE(leader >= 0);
  int follower = (leader + 1) % 3, other = (leader + 2) % 3;
  const auto timeout = 2s;
  Options o;
  o.timeout = timeout;
  EtcdClient c({etcd.endpoint(follower), etcd.endpoint(leader), etcd.endpoint(other)}, o);
  REQUIRE_OK(c.put("/k", "0"));

  auto lease = c.grant(2);
  REQUIRE_OK(lease);
  REQUIRE_OK(c.put("/alive", "x", lease.value.id));
  std::atomic<bool> lost_called{false};
  LeaseKeeper keeper(c, lease.value, [&](const std::string&) { lost_called = true; });

  etcd.kill(follower);
  for (int i = 1; i <= 20; ++i) {
    INFO("write " << i);
    auto s = c.put("/k", std::to_string(i));
    REQUIRE_OK(s);
    auto g = c.get("/k");
    REQUIRE_OK(g);
    CHECK(g.value->value == std::to_string(i));
  }
  std::this_thread::sleep_for(3s);  // more than the TTL: the keeper refreshes via live members
  CHECK(!keeper.lost());
  CHECK(present(c, "/alive"));

  // A second member gone: no quorum. A write fails within its deadline, saying why.
  etcd.kill(leader);
  auto t0 = Clock::now();
  auto s = c.put("/k", "no quorum");
  auto took = Clock::now() - t0;
  INFO(s.message);
  CHECK(!s.ok());
  CHECK((s.code == Code::kUnavailable || s.code == Code::kDeadlineExceeded));
  CHECK_THAT(s.message, Catch::Contains("quorum"));
  CHECK_THAT(s.message, Catch::Contains("put /k failed: etcd 127.0.0.1:"));
  CHECK(took < timeout + 1s);  // the deadline holds: no hang

  // Once the survivor has noticed (an election timeout), it refuses at once: "no leader".
  REQUIRE(eventually(
      [&] {
        auto r = c.put("/k", "no quorum");
        return !r.ok() && r.message.find("no leader (the etcd cluster lost quorum)") != std::string::npos;
      },
      10s));
  auto g = c.get("/k");
  CHECK(!g.ok());

  // The keeper cannot refresh any more: the lease is in doubt after its TTL, and lost after
  // kDoubtTtls more (each plus a margin).
  const auto ttl = std::chrono::seconds(lease.value.ttl_s);
  CHECK(eventually([&] { return keeper.in_doubt() || keeper.lost(); }, ttl + 2s));
  CHECK(eventually([&] { return keeper.lost(); }, LeaseKeeper::kDoubtTtls * ttl + 3s));
  CHECK(!keeper.in_doubt());
  CHECK(lost_called);
  CHECK_THAT(keeper.lost_reason(), Catch::Contains("no successful refresh") && Catch::Contains("quorum"));

  // Quorum back: the client works again without being rebuilt.
  etcd.restart(follower);
  CHECK(eventually([&] { return c.put("/k", "back").ok(); }, 30s));
  CHECK(c.get("/k").value->value == "back");
}

TEST_CASE("the etcd leader killed: a lease kept at etcd's minimum TTL survives the election") {
  trn::test::EtcdCluster etcd(3);
  etcd.start();
  int leader = etcd.leader();
  REQUIRE(leader >= 0);
  int follower = (leader + 1) % 3, other = (leader + 2) % 3;
  EtcdClient c({etcd.endpoint(follower), etcd.endpoint(leader), etcd.endpoint(other)});
  // The minimum TTL is 1.5 election timeouts (1 s here), and a refresh is due every TTL/3: the
  // TTL left after the last refresh is shorter than an election can take. etcd's new leader
  // extends every lease when it takes over, so the lease outlives the election in etcd; the
  // keeper must not give it up on its own clock alone.
  auto lease = c.grant(1);
  REQUIRE_OK(lease);
  REQUIRE_OK(c.put("/alive", "x", lease.value.id));
  std::atomic<bool> lost_called{false};
  std::atomic<int> doubts{0}, confirmations{0};
  LeaseKeeper keeper(
      c, lease.value, [&](const std::string&) { lost_called = true; },
      [&](const std::string& why) { ++(why.empty() ? confirmations : doubts); });
  std::this_thread::sleep_for(1500ms);
  etcd.kill(leader);
  std::this_thread::sleep_for(4s);
  INFO(keeper.lost_reason());
  CHECK(!keeper.lost());
  CHECK(!lost_called);
  CHECK(!keeper.in_doubt());
  CHECK(doubts == confirmations);  // each doubt, if any, ended by a refresh
  CHECK(present(c, "/alive"));
}
