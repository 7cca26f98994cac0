#include "collectives/calibrate.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn {
namespace {

double since_us(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

void measure(algo::Context& c, CostParams& p) {
  const int n = c.size();
  constexpr int kBarriers = 5;
  int rounds = 0;
  while ((1 << rounds) < n) ++rounds;
  // An untimed barrier first: the timed ones then start with every rank present and the
  // connections made (the first message to a peer over tcp;ofi_rxm opens its connection).
  algo::Context warm = c.with_step_base(900);
  algo::barrier_dissemination(warm);
  auto t0 = Clock::now();
  for (int i = 0; i < kBarriers; ++i) {
    algo::Context b = c.with_step_base(100 * i);
    algo::barrier_dissemination(b);
  }
  p.alpha_us = since_us(t0) / (kBarriers * std::max(rounds, 1));

  constexpr size_t kBytes = 1 << 20;
  std::vector<char> out(kBytes, 1), in(kBytes);
  t0 = Clock::now();
  auto rq = c.irecv((c.rank() + n - 1) % n, 1000, in.data(), kBytes);
  auto sq = c.isend((c.rank() + 1) % n, 1000, out.data(), kBytes);
  c.wait(rq);
  c.wait(sq);
  p.beta_us_per_kib = std::max(0.0, since_us(t0) - p.alpha_us) / 1024;

  std::vector<float> a(kBytes / 4, 1.0f), b(kBytes / 4, 2.0f);
  t0 = Clock::now();
  reduce(a.data(), b.data(), a.size(), DataType::kF32, ReduceOp::kSum);
  p.gamma_us_per_kib = since_us(t0) / 1024;
}

// Measures what the layout has: the links within hosts (every host at once, each among its own
// ranks) and between hosts (the first rank of each host). A set this rank does not measure is
// proposed as 0, so the agreement's maximum is the measured ranks' (the transport's table where
// nobody measured it).
void measure_model(algo::Context& c, const std::vector<int>& host_of, CostModel& m) {
  const HostLayout layout = host_layout(host_of);
  if (layout.hosts == 1) {
    measure(c, m.intra);
    m.inter = m.intra;
    return;
  }
  if (!layout.uniform() || layout.per_host == 1) {  // flat algorithms only: they run over inter
    measure(c, m.inter);
    return;
  }
  std::map<int, std::vector<int>> hosts;  // members of each host, in rank order
  for (int i = 0; i < c.size(); ++i) hosts[host_of[i]].push_back(i);
  std::vector<int> local, firsts;
  int my_local = 0, my_first = -1;
  for (auto& [h, members] : hosts) {
    if (members.front() == c.rank()) my_first = static_cast<int>(firsts.size());
    firsts.push_back(c.world_rank(members.front()));
    if (h != host_of[c.rank()]) continue;
    for (int i : members) {
      if (i == c.rank()) my_local = static_cast<int>(local.size());
      local.push_back(c.world_rank(i));
    }
  }
  // Hosts in order of their host value, which every rank shares.
  algo::Context lc = c.subgroup(local, my_local);
  measure(lc, m.intra);
  if (my_first >= 0) {
    algo::Context xc = c.subgroup(firsts, my_first);
    measure(xc, m.inter);
  } else {
    m.inter.alpha_us = m.inter.beta_us_per_kib = m.inter.gamma_us_per_kib = 0;
  }
}

// A 31-bit fingerprint of the grouping (member i -> index of its host by lowest member), exact
// as a double.
double layout_fingerprint(const std::vector<int>& host_of) {
  std::map<int, uint32_t> index;
  uint32_t h = 2166136261u;
  for (int v : host_of) {
    uint32_t k = index.emplace(v, static_cast<uint32_t>(index.size())).first->second;
    h = (h ^ k) * 16777619u;
  }
  return static_cast<double>(h & 0x7fffffffu);
}

}  // namespace

CostModel agree_on_params(algo::Context& c, CostModel proposal, bool measure_now, const std::vector<int>& host_of) {
  if (measure_now && c.size() > 1) measure_model(c, host_of, proposal);
  // Both sets, then the layout's fingerprint and its negation: after the maximum, the two agree
  // only if every rank had the same fingerprint.
  double v[2 * kCostParamCount + 2];
  to_array(proposal.intra, v);
  to_array(proposal.inter, v + kCostParamCount);
  const double fp = layout_fingerprint(host_of);
  v[2 * kCostParamCount] = fp;
  v[2 * kCostParamCount + 1] = -fp;
  algo::Context agree = c.with_step_base(2000);
  algo::allreduce_rhd(agree, v, 2 * kCostParamCount + 2, DataType::kF64, ReduceOp::kMax);
  if (v[2 * kCostParamCount] != -v[2 * kCostParamCount + 1])
    throw usage_error("the ranks of a communicator disagree on which ranks share a host (this rank sees {}): give "
                      "every rank the same CommOptions::hosts", host_layout(host_of).describe());
  CostModel agreed{from_array(v), from_array(v + kCostParamCount)};
  if (measure_now)
    log::info(log::Subsys::kColl,
              "measured cost model (max over ranks): within a host alpha {:.1f} us, beta {:.3f} us/KiB, gamma {:.3f} "
              "us/KiB; between hosts alpha {:.1f} us, beta {:.3f} us/KiB, gamma {:.3f} us/KiB",
              agreed.intra.alpha_us, agreed.intra.beta_us_per_kib, agreed.intra.gamma_us_per_kib, agreed.inter.alpha_us,
              agreed.inter.beta_us_per_kib, agreed.inter.gamma_us_per_kib);
  return agreed;
}

}  // namespace trn
