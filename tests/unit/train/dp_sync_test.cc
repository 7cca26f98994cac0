// Data-parallel gradient sync over an in-process transport (two ranks as threads): the averaged
// gradients equal one process's gradients over the global batch, and buckets start during
// backward.
#include <catch2/catch.hpp>

#include <thread>

#include "collectives/communicator.h"
#include "collectives/local_p2p.h"
#include "runtime/model/one_stage.h"
#include "runtime/train/dp_sync.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;

namespace {

const model::Config kCfg{2, 2, 16, 8, 13};

struct RankResult {
  std::vector<float> grads;
  double loss = 0;
  train::DataParallelSync::Stats stats;
  size_t buckets = 0;
};

std::vector<RankResult> run_dp(int world, const std::vector<int32_t>& in,
                               const std::vector<int32_t>& tg, int B, int T,
                               train::DataParallelOptions opt) {
  auto group = make_local_group(world);
  std::vector<RankResult> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto comm = std::make_shared<Communicator>(group[r]);
      const int b = B / world;
      model::OneStageModel m(kCfg, b, T, 1);
      m.init(21);
      train::DataParallelSync sync(comm, m.num_params(), opt);
      m.zero_grad();
      const size_t off = size_t(r) * b * T;
      const double loss = m.forward_backward(
          in.data() + off, tg.data() + off, 1.0f / float(b * T),
          [&](size_t begin, size_t end) { sync.grads_ready(m.grads(), begin, end); });
      sync.finish(m.grads(), m.num_params());
      out[r].loss = sync.mean(loss);
      out[r].grads.assign(m.grads(), m.grads() + m.num_params());
      out[r].stats = sync.stats();
      out[r].buckets = sync.num_buckets();
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("data-parallel gradients equal the one-process gradients of the global batch") {
  const int B = 4, T = 8;
  Rng rng(5);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.below(kCfg.vocab));
  for (auto& x : tg) x = int32_t(rng.below(kCfg.vocab));
  model::OneStageModel one(kCfg, B, T, 1);
  one.init(21);
  one.zero_grad();
  const double loss = one.forward_backward(in.data(), tg.data(), 1.0f / (B * T));
  const std::vector<double> expect(one.grads(), one.grads() + one.num_params());

  for (bool bf16 : {false, true}) {
    const auto ranks = run_dp(2, in, tg, B, T, {.bucket_bytes = 4096, .wire = bf16 ? train::GradWire::kBF16 : train::GradWire::kF32});
    INFO("bf16 " << bf16);
    for (const auto& r : ranks) {
      CHECK(r.loss == Approx(loss).epsilon(1e-6));
      CHECK(test::max_rel_diff(r.grads, expect) < (bf16 ? 1e-2 : 1e-6));
      CHECK(r.buckets > 4);
      CHECK(r.stats.buckets_started_in_backward == int64_t(r.buckets));  // all overlapped backward
      CHECK(r.stats.buckets_started_in_finish == 0);
    }
    CHECK(ranks[0].grads == ranks[1].grads);  // every rank ends with the same gradients
  }
}
