#include <catch2/catch.hpp>

#include <cmath>

#include "collectives/core/error.h"
#include "runtime/optim/adamw.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;

TEST_CASE("AdamW follows torch.optim.AdamW, decaying only 2-D tensors") {
  const model::Config c{1, 1, 4, 3, 5};
  model::ParamLayout lay(c);
  const size_t n = lay.total();
  auto p0 = test::random_vec(n, 60);
  std::vector<float> p(p0.begin(), p0.end());
  std::vector<double> pd = p0, m(n, 0.0), v(n, 0.0);
  optim::AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
  optim::AdamW opt(lay, cfg);
  ThreadPool pool(2);
  const float lrs[] = {1e-2f, 5e-3f, 2e-3f};
  for (int t = 1; t <= 3; ++t) {
    const auto g = test::random_vec(n, 60 + t);
    std::vector<float> gf(g.begin(), g.end());
    opt.step(p.data(), gf.data(), lrs[t - 1], pool);
    for (const auto& spec : lay.tensors())
      for (size_t i = spec.offset; i < spec.offset + spec.numel; ++i) {
        const double lr = lrs[t - 1], gi = gf[i];
        if (spec.decay) pd[i] *= 1.0 - lr * 0.1;
        m[i] = 0.9 * m[i] + 0.1 * gi;
        v[i] = 0.95 * v[i] + 0.05 * gi * gi;
        const double mhat_step = lr / (1 - std::pow(0.9, t));
        const double denom = std::sqrt(v[i]) / std::sqrt(1 - std::pow(0.95, t)) + 1e-8;
        pd[i] -= mhat_step * m[i] / denom;
      }
  }
  CHECK(opt.steps_taken() == 3);
  CHECK(test::max_rel_diff(p, pd) < 1e-6);
  // a bias moved without decay: with zero gradient and decay it would shrink, without it not
  std::vector<float> q(n, 1.0f), zero(n, 0.0f);
  optim::AdamW opt2(lay, cfg);
  opt2.step(q.data(), zero.data(), 0.5f, pool);
  CHECK(q[lay.find("ln_f.bias").offset] == 1.0f);
  CHECK(q[lay.find("wte.weight").offset] == Approx(1.0 - 0.5 * 0.1));
}

TEST_CASE("range_squares: each range's sum is its own sequential loop's, bit for bit") {
  // 19 ranges of uneven lengths (two groups of eight interleaved, three alone), some empty, one
  // overlapping another: the interleaving must not mix the running sums nor their order.
  const auto gd = test::random_vec(40000, 17);
  std::vector<float> g(gd.begin(), gd.end());
  std::vector<optim::Range> ranges;
  for (size_t i = 0; i < 19; ++i) {
    const size_t b = (i * 1931) % 30000, len = i % 5 == 0 ? 0 : 100 + (i * 7919) % 9000;
    ranges.push_back({b, b + len});
  }
  std::vector<double> out(ranges.size(), -1.0);
  optim::range_squares(g.data(), ranges.data(), ranges.size(), out.data());
  for (size_t i = 0; i < ranges.size(); ++i) {
    volatile double s = 0.0;  // one addition after another, in element order
    for (size_t j = ranges[i].begin; j < ranges[i].end; ++j) s = s + double(g[j]) * double(g[j]);
    CHECK(out[i] == s);
  }
}

TEST_CASE("gradient norm and clipping follow clip_grad_norm_") {
  std::vector<float> g(200000);
  for (size_t i = 0; i < g.size(); ++i) g[i] = float((i % 7) - 3) * 0.01f;
  double expect = 0;
  for (float x : g) expect += double(x) * x;
  ThreadPool one(1), two(2);
  const double s1 = optim::sum_of_squares(g.data(), g.size(), one);
  const double s2 = optim::sum_of_squares(g.data(), g.size(), two);
  CHECK(s1 == s2);  // same bits whatever the thread count
  CHECK(s1 == Approx(expect).epsilon(1e-12));
  const double norm = std::sqrt(s1);
  auto h = g;
  optim::clip_to_norm(h.data(), h.size(), norm, 2 * norm, two);  // below the limit: untouched
  CHECK(h == g);
  optim::clip_to_norm(h.data(), h.size(), norm, 0.0, two);  // 0: off
  CHECK(h == g);
  optim::clip_to_norm(h.data(), h.size(), norm, 1.0, two);
  CHECK(std::sqrt(optim::sum_of_squares(h.data(), h.size(), one)) == Approx(1.0).epsilon(1e-5));
}

TEST_CASE("learning-rate schedules: warm-up, cosine, constant") {
  optim::Schedule s{optim::Schedule::Kind::kCosine, 1.0f, 0.1f, 10, 110};
  CHECK(s.at(0) == Approx(0.1));
  CHECK(s.at(9) == Approx(1.0));
  CHECK(s.at(10) == Approx(1.0));
  CHECK(s.at(60) == Approx(0.55));
  CHECK(s.at(110) == Approx(0.1));
  CHECK(s.at(500) == Approx(0.1));
  s.kind = optim::Schedule::Kind::kConstant;
  CHECK(s.at(4) == Approx(0.5));
  CHECK(s.at(80) == 1.0f);
  CHECK_THROWS_AS(optim::parse_schedule("linear"), Error);
}

TEST_CASE("AdamW as an Optimizer: its norm is the buffer's sum of squares bit for bit, its update clips then steps and clears the gradients") {
  // Wide enough for several of the norm's 65536-element pieces, in one buffer or per tensor.
  const model::Config c{2, 2, 64, 16, 600};
  for (const bool per_tensor : {false, true}) {
    INFO((per_tensor ? "pieces per tensor" : "pieces of the whole buffer"));
    model::ParamLayout lay(c);
    const size_t n = lay.total();
    const auto gd = test::random_vec(n, 61);
    std::vector<float> g(gd.begin(), gd.end()), p(n, 0.5f);
    ThreadPool pool(3);
    const optim::AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f, 0.5f};
    // Per tensor with tp 1 and pp 1 counts every tensor: the sum of the tensors' sums of squares.
    optim::NormPieces pieces = optim::norm_pieces(lay, per_tensor ? 2 : 1, 1, 0, 0);
    for (auto& piece : pieces.pieces) piece.counted = true;
    optim::AdamW opt(lay, cfg, optim::NormGroup{pieces, nullptr});
    double expect = 0.0;
    if (per_tensor)
      for (const auto& t : lay.tensors()) expect += optim::sum_of_squares(g.data() + t.offset, t.numel, pool);
    else
      expect = optim::sum_of_squares(g.data(), n, pool);
    const double norm = opt.grad_norm(g.data(), pool);
    CHECK(norm == std::sqrt(expect));
    REQUIRE(norm > 0.5);  // the update clips
    CHECK(opt.shard() == nullptr);

    auto h = g;
    std::vector<float> q = p;
    optim::clip_to_norm(h.data(), n, norm, 0.5, pool);
    optim::AdamW ref(lay, cfg);
    ref.step(q.data(), h.data(), 1e-3f, pool);
    opt.update(p.data(), g.data(), norm, 1e-3f, pool);
    // The update reads each gradient clipped (h) and leaves it 0, as zero_grad would.
    CHECK(opt.clears_grads());
    CHECK(g == std::vector<float>(n, 0.0f));
    CHECK(p == q);
    CHECK(opt.m() == ref.m());
    CHECK(opt.steps_taken() == 1);
    CHECK(opt.kept_params(p.data(), n) == p);
  }
}
