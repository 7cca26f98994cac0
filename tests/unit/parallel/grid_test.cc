#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "collectives/core/error.h"
#include "runtime/model/config.h"
#include "runtime/parallel/grid.h"

using trn::parallel::Coords;
using trn::parallel::GridShape;

TEST_CASE("grid coordinates follow rank = (pp * dp + dp_rank) * tp + tp_rank") {
  const GridShape g{3, 2, 4};
  REQUIRE(g.world() == 24);
  for (int r = 0; r < g.world(); ++r) {
    const Coords c = g.coords_of(r);
    CHECK(g.rank_of(c) == r);
    CHECK(r == (c.pp * 3 + c.dp) * 2 + c.tp);
  }
  CHECK(g.coords_of(0) == Coords{0, 0, 0});
  CHECK(g.coords_of(1) == Coords{0, 1, 0});
  CHECK(g.coords_of(2) == Coords{1, 0, 0});
  CHECK(g.coords_of(6) == Coords{0, 0, 1});
  CHECK(g.coords_of(23) == Coords{2, 1, 3});
}

TEST_CASE("grid groups partition the world and vary one coordinate each") {
  for (GridShape g : {GridShape{1, 1, 1}, GridShape{2, 2, 1}, GridShape{2, 1, 4}, GridShape{1, 4, 2},
                      GridShape{2, 2, 2}, GridShape{3, 2, 2}}) {
    std::set<std::vector<int>> tp, dp, pp;
    for (int r = 0; r < g.world(); ++r) {
      const Coords c = g.coords_of(r);
      const auto t = g.tp_group(r), d = g.dp_group(r), p = g.pp_group(r);
      REQUIRE(int(t.size()) == g.tp);
      REQUIRE(int(d.size()) == g.dp);
      REQUIRE(int(p.size()) == g.pp);
      // This rank sits at its own coordinate in each group.
      CHECK(t[c.tp] == r);
      CHECK(d[c.dp] == r);
      CHECK(p[c.pp] == r);
      for (int i = 0; i < g.tp; ++i) CHECK((g.coords_of(t[i]) == Coords{c.dp, i, c.pp}));
      for (int i = 0; i < g.dp; ++i) CHECK((g.coords_of(d[i]) == Coords{i, c.tp, c.pp}));
      for (int i = 0; i < g.pp; ++i) CHECK((g.coords_of(p[i]) == Coords{c.dp, c.tp, i}));
      tp.insert(t), dp.insert(d), pp.insert(p);
    }
    // Each kind of group partitions the world: world / size groups of that size, disjoint.
    CHECK(int(tp.size()) == g.world() / g.tp);
    CHECK(int(dp.size()) == g.world() / g.dp);
    CHECK(int(pp.size()) == g.world() / g.pp);
    std::set<int> seen;
    for (const auto& grp : tp) seen.insert(grp.begin(), grp.end());
    CHECK(int(seen.size()) == g.world());
  }
  // TP groups are consecutive ranks.
  CHECK(GridShape{2, 4, 1}.tp_group(5) == std::vector<int>{4, 5, 6, 7});
  CHECK(GridShape{2, 4, 1}.dp_group(5) == std::vector<int>{1, 5});
}

TEST_CASE("the embedding group joins the first and last stage of one (dp, tp) position") {
  const GridShape g{2, 2, 3};  // 12 ranks; stage s holds ranks [4s, 4s+4)
  CHECK(g.embedding_group(1) == std::vector<int>{1, 9});
  CHECK(g.embedding_group(9) == std::vector<int>{1, 9});
  CHECK(g.embedding_group(5).empty());  // a middle stage
  CHECK(GridShape{2, 2, 1}.embedding_group(3) == std::vector<int>{3});
}

TEST_CASE("a layout that does not fit the world is one usage error naming a layout that does") {
  using Catch::Matchers::Contains;
  CHECK_NOTHROW(trn::parallel::check_layout(GridShape{2, 2, 1}, 4));
  try {
    trn::parallel::check_layout(GridShape{2, 2, 1}, 6);
    FAIL("no error");
  } catch (const trn::Error& e) {
    CHECK(e.kind() == trn::ErrorKind::kUsage);
    CHECK_THAT(e.what(), Contains("--dp 2 --tp 2 --pp 1 needs 4 workers but the job has 6"));
    CHECK_THAT(e.what(), Contains("--dp 3 --tp 2 --pp 1"));
  }
  try {
    trn::parallel::check_layout(GridShape{1, 4, 1}, 6);
    FAIL("no error");
  } catch (const trn::Error& e) {
    CHECK_THAT(e.what(), Contains("--dp 6 --tp 1 --pp 1"));
  }
  CHECK_THROWS_AS(trn::parallel::check_layout(GridShape{0, 1, 1}, 1), trn::Error);
}

TEST_CASE("context parallelism sits between tp and dp; the replicas are dp x cp") {
  for (GridShape g : {GridShape{1, 1, 1, 2}, GridShape{2, 2, 1, 2}, GridShape{2, 1, 2, 4}, GridShape{1, 2, 2, 2}}) {
    std::set<std::vector<int>> cp, reps, mp;
    for (int r = 0; r < g.world(); ++r) {
      const Coords c = g.coords_of(r);
      CHECK(g.rank_of(c) == r);
      const auto k = g.cp_group(r), d = g.dp_group(r), m = g.model_parallel_group(r);
      REQUIRE(int(k.size()) == g.cp);
      REQUIRE(int(d.size()) == g.replicas());
      REQUIRE(int(m.size()) == g.tp * g.pp);
      CHECK(k[c.cp] == r);
      CHECK(d[g.replica(c)] == r);
      for (int i = 0; i < g.cp; ++i) CHECK((g.coords_of(k[i]) == Coords{c.dp, c.tp, c.pp, i}));
      // A replica member varies dp and cp only; a model-parallel member tp and pp only.
      for (int q : d) CHECK((g.coords_of(q).tp == c.tp && g.coords_of(q).pp == c.pp));
      for (int q : m) CHECK(g.replica(g.coords_of(q)) == g.replica(c));
      cp.insert(k), reps.insert(d), mp.insert(m);
    }
    CHECK(int(cp.size()) == g.world() / g.cp);
    CHECK(int(reps.size()) == g.world() / g.replicas());
    CHECK(int(mp.size()) == g.replicas());
  }
  // dp 2 x tp 2 x cp 2: a cp group strides by tp and stays within a dp replica's 4 ranks.
  const GridShape g{2, 2, 1, 2};
  CHECK(g.cp_group(5) == std::vector<int>{5, 7});
  CHECK(g.dp_group(5) == std::vector<int>{1, 3, 5, 7});
  CHECK(g.describe() == "dp 2 x tp 2 x pp 1 x cp 2");
}

TEST_CASE("a context-parallel rank holds a head and a tail chunk of each sequence") {
  trn::model::Placement p;
  p.cp = 4;
  const int Tn = 8, L = 4;  // a sequence of 32 in 8 chunks of 4
  std::vector<int> seen(32, 0);
  for (p.cp_rank = 0; p.cp_rank < 4; ++p.cp_rank)
    for (int t = 0; t < Tn; ++t) ++seen[size_t(p.position(t, Tn))];
  for (int n : seen) CHECK(n == 1);  // every position exactly once
  p.cp_rank = 1;
  CHECK(p.position(0, Tn) == 1 * L);      // chunk 1
  CHECK(p.position(L, Tn) == 6 * L);      // chunk 2 x 4 - 1 - 1 = 6
  CHECK(p.position(Tn - 1, Tn) == 7 * L - 1);
}
