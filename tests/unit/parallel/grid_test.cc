#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "collectives/core/error.h"
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
