// The in-memory snapshots' placement (buddy_map) and recovery plan (plan_restore): pure
// functions of the grid, the hosts and what each rank holds.
#include <catch2/catch.hpp>

#include <fstream>
#include <set>

#include "runtime/train/metrics.h"
#include "runtime/train/snapshot.h"
#include "tests/support/process.h"

using trn::parallel::GridShape;
using trn::train::buddy_map;
using trn::train::BuddyMap;
using trn::train::HeldSteps;
using trn::train::plan_restore;

namespace {

// host_of for `hosts` hosts of `per_host` consecutive ranks (trnrun's placement).
std::vector<int64_t> hosts_of(int hosts, int per_host) {
  std::vector<int64_t> h;
  for (int i = 0; i < hosts; ++i)
    for (int j = 0; j < per_host; ++j) h.push_back(100 + i);
  return h;
}

void check_one_to_one(const BuddyMap& b) {
  std::set<int> held(b.holder.begin(), b.holder.end());
  CHECK(held.size() == b.holder.size());
  for (size_t r = 0; r < b.holder.size(); ++r) {
    CHECK(b.holder[r] != int(r));
    CHECK(b.ward(b.holder[r]) == int(r));
  }
}

}  // namespace

TEST_CASE("a data-parallel replica on another host holds a rank's copy, and nothing is sent") {
  // dp 2 x tp 2 x pp 2 on 4 hosts of 2 ranks: rank = (pp * dp + dp) * tp + tp.
  const GridShape g{2, 2, 2};
  const auto b = buddy_map(g, hosts_of(4, 2), false);
  CHECK(b.mirrored);
  for (int r = 0; r < 8; ++r) {
    const int h = b.holder[r];
    CHECK(g.coords_of(h).tp == g.coords_of(r).tp);
    CHECK(g.coords_of(h).pp == g.coords_of(r).pp);
    CHECK(g.coords_of(h).dp != g.coords_of(r).dp);
    CHECK(h / 2 != r / 2);  // another host
  }
  // Replicas all on one host: still the next replica.
  const auto one = buddy_map({2, 1, 1}, hosts_of(1, 2), false);
  CHECK(one.mirrored);
  CHECK(one.holder == std::vector<int>{1, 0});
}

TEST_CASE("without replicas (or under ZeRO) the same local rank on the next host holds the copy") {
  const auto b = buddy_map({1, 2, 2}, hosts_of(2, 2), false);
  CHECK_FALSE(b.mirrored);
  CHECK(b.holder == std::vector<int>{2, 3, 0, 1});
  check_one_to_one(b);
  const auto z = buddy_map({2, 2, 1}, hosts_of(2, 2), true);
  CHECK_FALSE(z.mirrored);
  CHECK(z.holder == std::vector<int>{2, 3, 0, 1});
  // One host: the next rank.
  const auto one = buddy_map({1, 4, 1}, hosts_of(1, 4), false);
  CHECK(one.holder == std::vector<int>{1, 2, 3, 0});
  check_one_to_one(one);
  // Uneven hosts: the next rank too (one to one).
  const auto uneven = buddy_map({1, 3, 1}, {7, 7, 9}, false);
  check_one_to_one(uneven);
  // A world of one keeps no second copy.
  CHECK(buddy_map({1, 1, 1}, {7}, false).holder == std::vector<int>{-1});
}

TEST_CASE("recovery goes on from the newest step held for every rank") {
  const GridShape g{1, 2, 1};
  const auto b = buddy_map(g, hosts_of(2, 1), false);  // rank 0's copy on 1, rank 1's on 0
  SECTION("a replaced rank receives its state from its holder's copy") {
    std::vector<HeldSteps> held(2);
    held[0] = {{4, 5}, {4, -1}, 0};  // rank 0 holds rank 1's copy of step 4 (5 was in flight)
    held[1] = {{-1, -1}, {-1, -1}, -1};  // rank 1 was replaced
    const auto plan = plan_restore(g, b, held, false);
    REQUIRE(plan.step == 4);
    REQUIRE(plan.transfers.size() == 1);
    CHECK(plan.transfers[0].to == 1);
    CHECK(plan.transfers[0].from == 0);
    CHECK(plan.transfers[0].from_copy);
  }
  SECTION("survivors one step apart go on from the step both hold") {
    std::vector<HeldSteps> held(2);
    held[0] = {{6, 7}, {6, 5}, 0};
    held[1] = {{6, 5}, {6, 5}, 1};
    const auto plan = plan_restore(g, b, held, false);
    CHECK(plan.step == 6);
    CHECK(plan.transfers.empty());
  }
  SECTION("no step past a bound: a replica that finished a step rank 0 failed in") {
    // dp 2: both ranks need the same state (key 0); rank 1 got through step 8's last collective,
    // rank 0 did not and wrote no metrics line for it.
    const GridShape dp2{2, 1, 1};
    const auto mirrored = buddy_map(dp2, hosts_of(2, 1), false);
    std::vector<HeldSteps> held(2);
    held[0] = {{7, 6}, {-1, -1}, 0};
    held[1] = {{7, 8}, {-1, -1}, 0};
    const auto unbounded = plan_restore(dp2, mirrored, held, false);
    CHECK(unbounded.step == 8);  // rank 0 would receive step 8 from rank 1
    CHECK(unbounded.transfers.size() == 1);
    held[0].bound = 7;
    const auto plan = plan_restore(dp2, mirrored, held, false);
    CHECK(plan.step == 7);
    CHECK(plan.transfers.empty());
    held[0].bound = 5;
    CHECK(plan_restore(dp2, mirrored, held, false).step == -1);
    CHECK(plan_restore(dp2, mirrored, held, false).why_none.find("step 5 or before") != std::string::npos);
  }
  SECTION("a state in nobody's memory leaves no plan, with the reason") {
    std::vector<HeldSteps> held(2);
    held[0] = {{3, -1}, {-1, -1}, 0};  // its ward's copy never completed
    held[1] = {{-1, -1}, {-1, -1}, -1};
    const auto plan = plan_restore(g, b, held, false);
    CHECK(plan.step == -1);
    CHECK(plan.why_none.find("rank 1") != std::string::npos);
    CHECK(plan_restore(g, b, std::vector<HeldSteps>(2), false).step == -1);  // a first start
  }
}

TEST_CASE("a mirrored replica sends its own snapshot to the replaced rank") {
  const GridShape g{2, 1, 1};
  const auto b = buddy_map(g, hosts_of(2, 1), false);
  std::vector<HeldSteps> held(2);
  held[0] = {{-1, -1}, {-1, -1}, -1};
  held[1] = {{9, 8}, {-1, -1}, 0};
  const auto plan = plan_restore(g, b, held, false);
  REQUIRE(plan.step == 9);
  REQUIRE(plan.transfers.size() == 1);
  CHECK(plan.transfers[0].to == 0);
  CHECK(plan.transfers[0].from == 1);
  CHECK_FALSE(plan.transfers[0].from_copy);
}

TEST_CASE("a job whose data-parallel size changed restores each shard from any rank that held it") {
  using trn::train::state_key;
  // dp 2 x tp 2 shrinks to dp 1 x tp 2: the survivors were ranks 2 and 3 (dp 1), now ranks 0, 1.
  const GridShape shrunk{1, 2, 1};
  const auto b1 = buddy_map(shrunk, hosts_of(1, 2), false);
  std::vector<HeldSteps> held(2);
  held[0] = {{10, 11}, {-1, -1}, state_key({2, 2, 1}, 2, false)};  // shard tp 0
  held[1] = {{10, 11}, {-1, -1}, state_key({2, 2, 1}, 3, false)};  // shard tp 1
  auto plan = plan_restore(shrunk, b1, held, false);
  CHECK(plan.step == 11);
  CHECK(plan.transfers.empty());
  // The two survivors come back in the other order: each receives the other's.
  std::swap(held[0], held[1]);
  plan = plan_restore(shrunk, b1, held, false);
  REQUIRE(plan.step == 11);
  REQUIRE(plan.transfers.size() == 2);
  CHECK(plan.transfers[0].to == 0);
  CHECK(plan.transfers[0].from == 1);
  CHECK_FALSE(plan.transfers[0].from_copy);
  // Growing back to dp 2: the new ranks 2 and 3 receive from the replica holding their shard.
  const GridShape grown{2, 2, 1};
  std::vector<HeldSteps> four(4);
  four[0] = {{20, 19}, {-1, -1}, state_key(shrunk, 0, false)};
  four[1] = {{20, 19}, {-1, -1}, state_key(shrunk, 1, false)};
  plan = plan_restore(grown, buddy_map(grown, hosts_of(2, 2), false), four, false);
  REQUIRE(plan.step == 20);
  REQUIRE(plan.transfers.size() == 2);
  CHECK(plan.transfers[0].to == 2);
  CHECK(plan.transfers[0].from == 0);
  CHECK(plan.transfers[1].to == 3);
  CHECK(plan.transfers[1].from == 1);
  // Under ZeRO-1 a replica's moments are its own: another dp size finds nothing in memory.
  std::vector<HeldSteps> zero(2);
  zero[0] = {{5, -1}, {-1, -1}, state_key({2, 2, 1}, 2, true)};
  zero[1] = {{5, -1}, {-1, -1}, state_key({2, 2, 1}, 3, true)};
  CHECK(plan_restore(shrunk, b1, zero, true).step == -1);
}

TEST_CASE("under ZeRO a job whose data-parallel size changed finds no snapshot and resumes from disk") {
  using trn::train::state_key;
  // ZeRO-1 at dp 4 shrinks to dp 2: each survivor's moments are a quarter of the buffer, not the
  // half its new rank owns, so no snapshot fits and the plan says so (a restart from disk).
  const GridShape shrunk{2, 1, 1};
  std::vector<HeldSteps> held(2);
  held[0] = {{10, 11}, {-1, -1}, state_key({4, 1, 1}, 0, true)};
  held[1] = {{10, 11}, {-1, -1}, state_key({4, 1, 1}, 1, true)};
  CHECK(state_key(shrunk, 0, true) != held[0].key);
  CHECK(plan_restore(shrunk, buddy_map(shrunk, hosts_of(1, 2), false), held, true).step == -1);
  // The same dp keeps its keys: a restart in place at dp 2 restores each rank's own.
  held[0].key = state_key(shrunk, 0, true);
  held[1].key = state_key(shrunk, 1, true);
  CHECK(plan_restore(shrunk, buddy_map(shrunk, hosts_of(1, 2), false), held, true).step == 11);
}

TEST_CASE("the metrics' last step bounds a recovery: the largest whole step line") {
  trn::test::TempDir dir;
  const std::string path = dir.path() + "/m.jsonl";
  CHECK(trn::train::last_metrics_step(path) == -1);  // no file: no bound
  std::ofstream(path) << "{\"step\": 1, \"loss\": 5.5}\n{\"summary\": 1}\n{\"step\": 12, \"loss\": 5.1}\n"
                      << "{\"step\": 3, \"loss\": 5.4}\n{\"step\": 13, \"lo";  // cut short by a kill
  CHECK(trn::train::last_metrics_step(path) == 12);
  std::ofstream(path) << "";
  CHECK(trn::train::last_metrics_step(path) == 0);
}
