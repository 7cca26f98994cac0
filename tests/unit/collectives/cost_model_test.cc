#include <catch2/catch.hpp>

#include <limits>

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
  CHECK_THROWS_WITH(parse_algo("bcube"), Catch::Contains("ring, tree, rhd, hier or auto"));
}

TEST_CASE("ring segments up to the transport's limit travel whole, larger ones in chunks") {
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
  shm.link_shared = 0.5;
  shm.a2a_chunk_kib = 64;
  // Every parameter survives the agreement's flat array.
  double v[kCostParamCount];
  to_array(shm, v);
  CostParams back = from_array(v);
  CHECK(back.ring_unchunked_kib == shm.ring_unchunked_kib);
  CHECK(back.chunk_kib == shm.chunk_kib);
  CHECK(back.ring_overlap == shm.ring_overlap);
  CHECK(back.link_shared == shm.link_shared);
  CHECK(back.a2a_chunk_kib == shm.a2a_chunk_kib);
}

TEST_CASE("the all-to-alls chunk as the ring over shm and in 1 MiB pieces over tcp") {
  CHECK(a2a_chunk_bytes(params_for_transport("shm")) == size_t{256} << 10);
  CHECK(a2a_chunk_bytes(params_for_transport("tcp;ofi_rxm")) == size_t{1} << 20);
  // Other providers keep the pipeline chunk: only tcp's was measured.
  CHECK(a2a_chunk_bytes(params_for_transport("udp;ofi_rxd")) == size_t{256} << 10);
  CostParams p;
  p.chunk_kib = 8;
  CHECK(a2a_chunk_bytes(p) == size_t{8} << 10);  // 0: the pipeline chunk
  p.a2a_chunk_kib = 0.5;
  CHECK(a2a_chunk_bytes(p) == 512);
  // Two hosts over tcp, shm within each: chunks by link.
  CostModel m = model_for_transport("rank 0/4 tcp;ofi_rxm on eth0 + shm to 1 rank(s) on this host");
  CHECK(a2a_chunk_bytes(m.intra) == size_t{256} << 10);
  CHECK(a2a_chunk_bytes(m.inter) == size_t{1} << 20);
}

namespace {
const char* kTwoHostsTcpShm = "rank 0/4 tcp;ofi_rxm on eth0 + shm to 1 rank(s) on this host + shared-memory rings "
                              "to 1 rank(s) (messages up to 262144 bytes inside)";
}  // namespace

TEST_CASE("the host layout counts hosts and ranks per host, in order of each host's lowest rank") {
  HostLayout two = host_layout({0, 0, 2, 2});
  CHECK(two.hosts == 2);
  CHECK(two.per_host == 2);
  CHECK(two.hierarchical());
  CHECK(two.describe() == "2 hosts x 2 ranks");
  HostLayout interleaved = host_layout({7, 3, 7, 3, 7, 3});
  CHECK(interleaved.describe() == "2 hosts x 3 ranks");
  HostLayout uneven = host_layout({4, 4, 4, 1});
  CHECK(!uneven.uniform());
  CHECK(!uneven.hier_possible());
  CHECK(uneven.describe() == "4 ranks on 2 hosts (3 + 1)");
  CHECK(host_layout({0, 0, 0}).describe() == "1 host x 3 ranks");
  CHECK(!host_layout({0, 0, 0}).hierarchical());
  CHECK(!host_layout({0, 1, 2}).hierarchical());
}

TEST_CASE("a transport's two kinds of link get their own parameters") {
  CostModel both = model_for_transport(kTwoHostsTcpShm);
  CHECK(both.inter.alpha_us == params_for_transport("tcp").alpha_us);
  CHECK(both.intra.alpha_us == params_for_transport("shm").alpha_us);
  CHECK(both.intra.beta_us_per_kib < both.inter.beta_us_per_kib);
  CostModel tcp = model_for_transport("rank 0/2 tcp;ofi_rxm on lo");
  CHECK(tcp.intra.alpha_us == tcp.inter.alpha_us);
  CostModel shm = model_for_transport("rank 0/4 shm on shm + shared-memory rings to 3 rank(s)");
  CHECK(shm.inter.alpha_us == params_for_transport("shm").alpha_us);
  // Flat algorithms across hosts run at the speed of the links between hosts.
  CHECK(flat_params(host_layout({0, 0, 1, 1}), both).alpha_us == both.inter.alpha_us);
  CHECK(flat_params(host_layout({0, 0, 0, 0}), both).alpha_us == both.intra.alpha_us);
}

TEST_CASE("a host's bandwidth to others is the sum of its rails when large messages stripe over them") {
  const CostModel one = model_for_transport(kTwoHostsTcpShm);
  const CostModel four = model_for_transport(
      "rank 0/4 tcp;ofi_rxm on eth0, 4 rails eth0+eth1+eth2+eth3 (own rail eth0; messages of 262144 bytes or more "
      "to other hosts striped over all) + shm to 1 rank(s) on this host");
  CHECK(four.inter.beta_us_per_kib == Approx(one.inter.beta_us_per_kib / 4));
  CHECK(four.inter.alpha_us == one.inter.alpha_us);
  CHECK(four.intra.beta_us_per_kib == one.intra.beta_us_per_kib);
  // Rails that do not stripe (a provider without remote CQ data) add no bandwidth to a message.
  const CostModel unstriped = model_for_transport(
      "rank 0/4 tcp;ofi_rxm on eth0, 2 rails eth0+eth1 (own rail eth0; no striping: the provider carries no remote "
      "CQ data) + shm to 1 rank(s) on this host");
  CHECK(unstriped.inter.beta_us_per_kib == one.inter.beta_us_per_kib);
}

TEST_CASE("the cost model never picks hier on one host, with one rank per host, or on uneven hosts") {
  CostModel m = model_for_transport(kTwoHostsTcpShm);
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0, 0, 0}, std::vector<int>{0, 1, 2, 3},
                                        std::vector<int>{0, 0, 0, 1}, std::vector<int>{0, 0, 1, 1, 1, 2}}) {
    HostLayout l = host_layout(hosts);
    INFO(l.describe());
    for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) CHECK(choose_allreduce(l, b, m) != Algo::kHier);
    CHECK(describe_crossovers(l, m).find("hier") == std::string::npos);
  }
  // On one host the choice is the flat model's over the intra-host parameters.
  for (size_t b = 8; b <= (size_t{1} << 30); b *= 4)
    CHECK(choose_allreduce(host_layout({0, 0, 0, 0}), b, m) == choose_allreduce(4, b, m.intra));
  CHECK(allreduce_cost_us(Algo::kHier, host_layout({0, 0, 1}), 1024, m) == std::numeric_limits<double>::infinity());
}

TEST_CASE("across hosts with fast links within them the cost model picks hier where it models fastest") {
  CostModel m = model_for_transport(kTwoHostsTcpShm);
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3},
                                        std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}}) {
    HostLayout l = host_layout(hosts);
    INFO(l.describe() << ": " << describe_crossovers(l, m));
    // Latency-bound sizes: hier crosses hosts in log2(hosts) messages instead of log2(ranks)
    // (rhd) or 2(ranks - 1) (ring), and its other messages take shm.
    for (size_t b : {size_t{8}, size_t{4096}, size_t{65536}}) CHECK(choose_allreduce(l, b, m) == Algo::kHier);
    // The choice is the cheapest modelled one, at every size.
    for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) {
      const Algo a = choose_allreduce(l, b, m);
      for (Algo other : {Algo::kRing, Algo::kTree, Algo::kRhd, Algo::kHier})
        CHECK(allreduce_cost_us(a, l, b, m) <= allreduce_cost_us(other, l, b, m));
    }
  }
  // tcp between hosts: each connection runs at its own speed, so hier moves a host's share of
  // the vector across in fewer bytes per connection than the ring and wins at every size on
  // these layouts (as measured on the test bed).
  for (const std::vector<int>& hosts : {std::vector<int>{0, 0, 1, 1}, std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}})
    for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) CHECK(choose_allreduce(host_layout(hosts), b, m) == Algo::kHier);
  // Over a link the host's ranks split (efa), hier's phase across hosts is slower and, where
  // bandwidth dominates, the flat ring wins on 2 hosts x 2 ranks.
  CostModel shared = m;
  shared.inter.link_shared = 1;
  CHECK(allreduce_cost_us(Algo::kHier, host_layout({0, 0, 1, 1}), 64 << 20, shared) >
        allreduce_cost_us(Algo::kHier, host_layout({0, 0, 1, 1}), 64 << 20, m));
  CHECK(choose_allreduce(host_layout({0, 0, 1, 1}), size_t{1} << 30, shared) == Algo::kRing);
  CHECK(choose_allreduce(host_layout({0, 0, 1, 1}), 4096, shared) == Algo::kHier);
  // When links between hosts are slow (1 ms), hier wins at every size on 2 hosts x 2 ranks.
  CostModel slow = m;
  slow.inter.alpha_us = 1000;
  for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) CHECK(choose_allreduce(host_layout({0, 0, 1, 1}), b, slow) == Algo::kHier);
  // And with links between hosts as fast as within them, the host grouping buys nothing: flat.
  CostModel alike = uniform_model(m.intra);
  CHECK(choose_allreduce(host_layout({0, 0, 1, 1}), size_t{64} << 20, alike) != Algo::kHier);
  // hier's phase across hosts runs a flat algorithm over one rank per host.
  CHECK(hier_cross_algo(host_layout({0, 0, 1, 1}), 8, m) == Algo::kRhd);
  CHECK(parse_algo("hier") == Algo::kHier);
  CHECK(std::string(to_string(Algo::kHier)) == "hier");
}

TEST_CASE("rhd doubles whole vectors up to where the cost model's halving becomes cheaper, further on a slower link") {
  const CostParams tcp = params_for_transport("tcp;ofi_rxm"), shm = params_for_transport("shm");
  // 2 ranks: doubling and halving move the same bytes; doubling saves a message and reduces
  // twice the elements, so it pays up to alpha / (gamma / 2): 40 / 0.06 KiB over tcp.
  CHECK(rhd_doubling_max_bytes(2, tcp) == static_cast<size_t>(40 / 0.06 * 1024));
  CHECK(rhd_doubling_max_bytes(2, shm) < rhd_doubling_max_bytes(2, tcp));
  CHECK(rhd_doubling_max_bytes(1, tcp) == 0);
  // More ranks: doubling moves log2 p whole vectors, so it stops sooner.
  CHECK(rhd_doubling_max_bytes(8, tcp) < rhd_doubling_max_bytes(4, tcp));
  CHECK(rhd_doubling_max_bytes(4, tcp) < rhd_doubling_max_bytes(2, tcp));
  // rhd's modelled time is the cheaper branch on either side of the crossover, and continuous there.
  for (int n : {2, 4, 8}) {
    const size_t at = rhd_doubling_max_bytes(n, tcp);
    const double below = allreduce_cost_us(Algo::kRhd, n, at, tcp), above = allreduce_cost_us(Algo::kRhd, n, at + 1024, tcp);
    INFO(n << " ranks, crossover " << at << " B");
    CHECK(above >= below);
    CHECK(above - below < 0.1 * below);
  }
  // With no reduction cost, 2 ranks always double (the same bytes in fewer messages).
  CostParams free_reduce = tcp;
  free_reduce.gamma_us_per_kib = 0;
  CHECK(rhd_doubling_max_bytes(2, free_reduce) == std::numeric_limits<size_t>::max());
}
