#include <catch2/catch.hpp>

#include "collectives/core/error.h"
#include "collectives/cost_model.h"

using namespace trn;

TEST_CASE("the cost model picks a latency-bound algorithm for small messages and ring for large ones") {
  CostParams p;
  p.alpha_us = 20;
  p.beta_us_per_kib = 0.5;
  p.gamma_us_per_kib = 0.2;
  p.ring_overlap = 0.5;
  // 8 ranks, 8 bytes: ring needs 14 message latencies, rhd 6, tree 6 + fill.
  CHECK(choose_allreduce(8, 8, p) != Algo::kRing);
  CHECK(allreduce_cost_us(Algo::kRing, 8, 8, p) > allreduce_cost_us(Algo::kRhd, 8, 8, p));
  // 256 MiB: ring hides half of its reduction behind transfers; it wins.
  CHECK(choose_allreduce(8, size_t{256} << 20, p) == Algo::kRing);
  // Non-power-of-two worlds pay rhd's fix-up: 7 ranks, 64 MiB is ring.
  CHECK(choose_allreduce(7, size_t{64} << 20, p) == Algo::kRing);
  // One rank costs nothing.
  CHECK(allreduce_cost_us(Algo::kTree, 1, 1 << 20, p) == 0);
}

TEST_CASE("cost model crossovers are reported in increasing size with a change at each") {
  CostParams p = params_for_transport("tcp;ofi_rxm");
  auto xs = crossovers(8, p);
  REQUIRE(!xs.empty());
  CHECK(xs.front().bytes == 8);
  for (size_t i = 1; i < xs.size(); ++i) {
    CHECK(xs[i].bytes > xs[i - 1].bytes);
    CHECK(xs[i].algo != xs[i - 1].algo);
    CHECK(choose_allreduce(8, xs[i].bytes, p) == xs[i].algo);
    CHECK(choose_allreduce(8, xs[i].bytes / 2, p) == xs[i - 1].algo);
  }
  CHECK(describe_crossovers(8, p).find("from 8 B") != std::string::npos);
}

TEST_CASE("modelled time grows with size and the parameters depend on the transport") {
  for (Algo a : {Algo::kRing, Algo::kTree, Algo::kRhd}) {
    CostParams p = params_for_transport("shm");
    CHECK(allreduce_cost_us(a, 4, 1 << 10, p) < allreduce_cost_us(a, 4, 1 << 20, p));
  }
  CHECK(params_for_transport("shm").alpha_us < params_for_transport("tcp").alpha_us);
  CHECK(parse_algo("rhd") == Algo::kRhd);
  CHECK_THROWS_WITH(parse_algo("bcube"), Catch::Contains("ring, tree, rhd or auto"));
}

TEST_CASE("ring segments up to the transport's limit travel whole; larger ones in chunks") {
  CostParams p = params_for_transport("shm");
  p.ring_unchunked_kib = 2048;
  const size_t chunk = static_cast<size_t>(p.chunk_kib * 1024);
  const size_t whole = size_t{2048} << 10;
  CHECK(ring_chunk_bytes(p, chunk, whole) == whole);
  CHECK(ring_chunk_bytes(p, chunk, whole + 1) == chunk);
  CHECK(ring_chunk_bytes(p, chunk, chunk / 2) == chunk);  // one chunk either way
  // shm and tcp chunk every segment longer than a chunk.
  CostParams shm = params_for_transport("shm");
  CHECK(ring_chunk_bytes(shm, 256 << 10, 8 << 20) == size_t{256} << 10);
  CostParams tcp = params_for_transport("tcp;ofi_rxm");
  CHECK(ring_chunk_bytes(tcp, 256 << 10, 1 << 20) == size_t{256} << 10);
  shm.ring_unchunked_kib = 2048;
  // Every parameter survives the agreement's flat array.
  double v[kCostParamCount];
  to_array(shm, v);
  CostParams back = from_array(v);
  CHECK(back.ring_unchunked_kib == shm.ring_unchunked_kib);
  CHECK(back.chunk_kib == shm.chunk_kib);
  CHECK(back.ring_overlap == shm.ring_overlap);
}
