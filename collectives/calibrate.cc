#include "collectives/calibrate.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "collectives/algorithms/algorithm.h"
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

}  // namespace

CostParams agree_on_params(algo::Context& c, CostParams proposal, bool measure_now) {
  if (measure_now && c.size() > 1) measure(c, proposal);
  double v[kCostParamCount];
  to_array(proposal, v);
  algo::Context agree = c.with_step_base(2000);
  algo::allreduce_rhd(agree, v, kCostParamCount, DataType::kF64, ReduceOp::kMax);
  CostParams agreed = from_array(v);
  if (measure_now)
    log::info(log::Subsys::kColl,
              "measured cost model: alpha {:.1f} us, beta {:.3f} us/KiB, gamma {:.3f} us/KiB (max over ranks)",
              agreed.alpha_us, agreed.beta_us_per_kib, agreed.gamma_us_per_kib);
  return agreed;
}

}  // namespace trn
