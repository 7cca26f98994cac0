// ZeRO-1: the partition of a rank's buffer over its data-parallel group (every element owned
// once, equal slices per bucket, buckets on norm-piece boundaries), the norm's pieces (their
// sums, combined, are the unsharded norm bit for bit), and one training step over in-process
// ranks (threads) against the all-reduce path: bit-identical with 2 ranks, to rounding with 3.
#include <catch2/catch.hpp>

#include <cmath>
#include <thread>

#include "collectives/communicator.h"
#include "collectives/local_p2p.h"
#include "runtime/model/one_stage.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/zero.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/train/dp_sync.h"
#include "runtime/train/zero_sync.h"
#include "tests/unit/train/grad_check.h"

using namespace trn;

namespace {

// A rank's layout: the whole model, a tensor-parallel shard, or a pipeline stage.
struct Case {
  const char* what;
  model::Config cfg;
  int tp = 1, tp_rank = 0, pp = 1, pp_rank = 0;
};

model::ParamLayout layout_of(const Case& c) {
  model::Placement p{c.tp, c.tp_rank, {}};
  if (c.pp > 1) p.chunks = pipeline::chunks_of(c.cfg, {c.pp, 2, 1}, c.pp_rank);
  return model::ParamLayout(c.cfg, p);
}

std::vector<size_t> wte_bounds(const Case& c, const model::ParamLayout& lay) {
  const model::TensorSpec* wte = lay.find_or_null("wte.weight");
  if (c.pp == 1 || !wte) return {};
  return {wte->offset, wte->offset + wte->numel};
}

// The unsharded norm's sum, as the trainer computes it without ZeRO.
double unsharded(const Case& c, const model::ParamLayout& lay, const float* g, ThreadPool& pool) {
  if (c.tp == 1 && c.pp == 1) return optim::sum_of_squares(g, lay.total(), pool);
  double local = 0.0;
  for (const auto& t : lay.tensors()) {
    if (t.replicated() && c.tp_rank != 0) continue;
    if (t.name == "wte.weight" && c.pp_rank != 0) continue;
    local += optim::sum_of_squares(g + t.offset, t.numel, pool);
  }
  return local;
}

const model::Config kWide{4, 4, 64, 32, 301};  // ~210k parameters: several norm chunks

const Case kCases[] = {
    {"whole model", kWide},
    {"tp 2 rank 1", kWide, 2, 1},
    {"pp 2 first stage", kWide, 1, 0, 2, 0},
    {"pp 2 last stage", kWide, 1, 0, 2, 1},
    {"tp 2 rank 0 x pp 2 last stage", kWide, 2, 0, 2, 1},
};

}  // namespace

TEST_CASE("ZeRO-1 plan: equal slices per bucket, each element owned once, buckets end on norm pieces") {
  for (const Case& c : kCases)
    for (int dp : {1, 2, 3, 4})
      for (size_t bucket : {size_t(1), size_t(1000), optim::kSumChunk, size_t(1) << 24}) {
        INFO(c.what << ", dp " << dp << ", buckets of " << bucket);
        const auto lay = layout_of(c);
        const size_t n = lay.total();
        const auto pieces = optim::norm_pieces(lay, c.tp, c.pp, c.tp_rank, c.pp_rank);
        const auto cuts = pieces.cuts();
        const auto forced = wte_bounds(c, lay);
        const optim::ZeroPlan plan(n, dp, bucket, cuts, forced);
        // Buckets tile the buffer, each ending on a piece boundary and at every forced one.
        size_t at = 0;
        std::vector<size_t> ends;
        for (const auto& b : plan.buckets()) {
          CHECK(b.begin == at);
          CHECK(b.end > b.begin);
          CHECK(std::binary_search(cuts.begin(), cuts.end(), b.end));
          // At least the requested size, unless a forced boundary or the end came first.
          const bool cut_short = b.end == n || std::find(forced.begin(), forced.end(), b.end) != forced.end();
          CHECK((b.end - b.begin >= bucket || cut_short));
          at = b.end;
          ends.push_back(b.end);
        }
        CHECK(at == n);
        for (size_t f : forced) CHECK(std::find(ends.begin(), ends.end(), f) != ends.end());
        // Slices: dp equal ones per bucket (what reduce_scatter needs), the tail on the last rank.
        std::vector<int> owner(n, -1);
        for (size_t k = 0; k < plan.buckets().size(); ++k) {
          CHECK(plan.tail(k) < size_t(dp));
          for (int r = 0; r < dp; ++r) {
            const optim::Range s = plan.slice(k, r);
            CHECK(s.size() == plan.buckets()[k].slice + (r == dp - 1 ? plan.tail(k) : 0));
          }
        }
        size_t total = 0;
        for (int r = 0; r < dp; ++r) {
          for (const optim::Range& s : plan.owned(r))
            for (size_t i = s.begin; i < s.end; ++i) {
              CHECK(owner[i] == -1);
              owner[i] = r;
            }
          const size_t mine = plan.owned_elements(r);
          total += mine;
          // About 1/dp: off by at most the tails.
          CHECK(std::abs(double(mine) - double(n) / dp) <= double(plan.buckets().size() * dp));
        }
        CHECK(total == n);
        CHECK(std::count(owner.begin(), owner.end(), -1) == 0);
        // Every counted piece is covered by fragments on consecutive ranks, in order, starting
        // from 0 on the first and complete on the last.
        std::vector<std::vector<std::pair<int, optim::Fragment>>> of(pieces.pieces.size());
        for (int r = 0; r < dp; ++r) {
          const auto fr = optim::fragments(plan, pieces, r);
          REQUIRE(fr.size() == plan.buckets().size());
          for (const auto& bucket_fragments : fr)
            for (const auto& f : bucket_fragments) of[f.piece].push_back({r, f});
        }
        for (size_t i = 0; i < pieces.pieces.size(); ++i) {
          const auto& p = pieces.pieces[i];
          if (!p.counted) {
            CHECK(of[i].empty());
            continue;
          }
          REQUIRE(!of[i].empty());
          std::sort(of[i].begin(), of[i].end(), [](auto& a, auto& b) { return a.second.begin < b.second.begin; });
          size_t pos = p.begin;
          for (size_t j = 0; j < of[i].size(); ++j) {
            const auto& [r, f] = of[i][j];
            CHECK(f.begin == pos);
            CHECK(f.first == (j == 0));
            CHECK(f.last == (j + 1 == of[i].size()));
            if (j) CHECK(r == of[i][j - 1].first + 1);
            pos = f.end;
          }
          CHECK(pos == p.end);
        }
      }
}

TEST_CASE("the norm's piece sums, combined, are the unsharded sum of squares bit for bit") {
  ThreadPool pool(3);
  for (const Case& c : kCases) {
    INFO(c.what);
    const auto lay = layout_of(c);
    const auto pieces = optim::norm_pieces(lay, c.tp, c.pp, c.tp_rank, c.pp_rank);
    const auto g = test::to_float(test::random_vec(lay.total(), 17, 1e-2));
    std::vector<double> sums(pieces.pieces.size(), 0.0);
    for (size_t i = 0; i < sums.size(); ++i) {
      const auto& p = pieces.pieces[i];
      for (size_t j = p.begin; j < p.end; ++j) sums[i] += double(g[j]) * g[j];
    }
    CHECK(pieces.combine(sums) == unsharded(c, lay, g.data(), pool));
  }
}

namespace {

struct StepResult {
  std::vector<float> params;
  double norm = 0;
};

// One step of every rank over world in-process ranks: forward and backward of its slice of the
// batch, the sync (ZeRO-1 or all-reduce), the norm, clipping to 0.5 (so it scales) and AdamW.
std::vector<StepResult> train_step(const Case& c, int world, bool zero, size_t bucket_bytes, bool bf16 = false) {
  const int B = 6, T = 16;
  Rng rng(5);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.below(c.cfg.vocab));
  for (auto& x : tg) x = int32_t(rng.below(c.cfg.vocab));
  auto group = make_local_group(world);
  std::vector<StepResult> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto comm = std::make_shared<Communicator>(group[r]);
      const int b = B / world;
      model::OneStageModel m(c.cfg, b, T, 1);
      m.init(21);
      ThreadPool& pool = m.pool();
      const auto& lay = m.layout();
      const train::DataParallelOptions opt{.bucket_bytes = bucket_bytes, .wire = bf16 ? train::GradWire::kBF16 : train::GradWire::kF32};
      std::unique_ptr<train::GradientSync> sync;
      train::ZeroSync* zs = nullptr;  // the ZeRO-1 sync, when it runs
      if (zero) {
        auto z = std::make_unique<train::ZeroSync>(comm, m.num_params(), optim::norm_pieces(lay, 1, 1, 0, 0), opt);
        zs = z.get();
        sync = std::move(z);
      } else {
        sync = std::make_unique<train::DataParallelSync>(comm, m.num_params(), opt);
      }
      m.zero_grad();
      const size_t off = size_t(r) * b * T;
      m.forward_backward(in.data() + off, tg.data() + off, 1.0f / float(b * T),
                         [&](size_t begin, size_t end) { sync->grads_ready(m.grads(), begin, end); });
      sync->finish(m.grads(), m.num_params());
      const optim::AdamWConfig cfg{0.9f, 0.95f, 1e-8f, 0.1f};
      if (train::ZeroSync* z = zs) {
        const auto& pc = z->pieces();
        out[r].norm = std::sqrt(pc.combine(z->piece_sums(m.grads(), pool)));
        for (const auto& s : z->owned()) optim::clip_to_norm(m.grads() + s.begin, s.size(), out[r].norm, 0.5, pool);
        optim::AdamW adamw(lay, cfg, z->owned());
        adamw.step(m.params(), m.grads(), 1e-3f, pool);
        z->gather_params(m.params());
      } else {
        out[r].norm = std::sqrt(optim::sum_of_squares(m.grads(), m.num_params(), pool));
        optim::clip_to_norm(m.grads(), m.num_params(), out[r].norm, 0.5, pool);
        optim::AdamW adamw(lay, cfg);
        adamw.step(m.params(), m.grads(), 1e-3f, pool);
      }
      out[r].params.assign(m.params(), m.params() + m.num_params());
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("a ZeRO-1 step over 2 ranks equals the all-reduce step bit for bit, over 3 to rounding") {
  const Case c{"whole model", kWide};
  for (size_t bucket : {size_t(4096), size_t(1) << 20}) {
    INFO("buckets of " << bucket << " bytes");
    const auto ref2 = train_step(c, 2, false, bucket);
    const auto z2 = train_step(c, 2, true, bucket);
    REQUIRE(ref2[0].norm > 0.5);  // clipping scaled the gradients
    for (int r = 0; r < 2; ++r) {
      CHECK(z2[r].norm == ref2[r].norm);
      CHECK(z2[r].params == ref2[r].params);
    }
    const auto ref3 = train_step(c, 3, false, bucket);
    const auto z3 = train_step(c, 3, true, bucket);
    for (int r = 0; r < 3; ++r) {
      CHECK(z3[r].norm == Approx(ref3[r].norm).epsilon(1e-6));
      CHECK(test::max_rel_diff(z3[r].params, std::vector<double>(ref3[r].params.begin(), ref3[r].params.end())) < 1e-5);
      CHECK(z3[r].params == z3[0].params);  // the all-gather leaves every rank the same weights
    }
  }
}

TEST_CASE("a ZeRO-1 step with bf16 gradients equals the bf16 all-reduce step over 2 ranks") {
  const Case c{"whole model", kWide};
  const auto ref = train_step(c, 2, false, 8192, true);
  const auto z = train_step(c, 2, true, 8192, true);
  CHECK(z[0].norm == ref[0].norm);
  CHECK(z[0].params == ref[0].params);
  CHECK(z[1].params == ref[1].params);
}
