// Tensor parallelism in one process: shards of a layout map back onto the global tensors, every
// shard initialises itself to its slice of the one-process model, and a TP group of ranks (threads
// over the in-process transport) computes the one-process loss and gradients, in double
// precision to rounding, including a vocabulary that the group size does not divide.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <thread>

#include "collectives/communicator.h"
#include "collectives/local_p2p.h"
#include "runtime/model/one_stage.h"
#include "runtime/model/stage.h"
#include "runtime/util/random.h"

using namespace trn;
using model::Config;
using model::ParamLayout;
using model::Placement;

namespace {

const Config kCfg{2, 4, 16, 6, 11};  // n_layer, n_head, d_model, ctx, vocab (odd: padded under tp)

// Llama of the same size with grouped-query attention (8 heads over 4 KV heads) and an untied
// head: tp 2 and 4 split both.
Config llama_cfg() {
  Config c{2, 8, 16, 6, 11};
  c.arch = "llama";
  c.n_kv_head = 4;
  c.ffn_dim = 24;
  c.tie_embeddings = false;
  return c;
}

std::vector<double> random_global(const ParamLayout& full, uint64_t seed) {
  Rng r(seed);
  std::vector<double> v(full.total());
  for (auto& x : v) x = r.normal() * 0.3;
  return v;
}

// This rank's shard of a global double buffer (copy_from_global is float; the mapping is the
// same, so go through global indices).
std::vector<double> shard_of(const ParamLayout& local, const ParamLayout& full,
                             const std::vector<double>& g) {
  std::vector<double> out(local.total(), 0.0);
  for (const auto& t : local.tensors()) {
    const auto& ft = full.find(t.name);
    for (size_t i = 0; i < t.numel; ++i) {
      const int64_t gi = t.global_index(i);
      out[t.offset + i] = gi < 0 ? 0.0 : g[ft.offset + size_t(gi)];
    }
  }
  return out;
}

}  // namespace

TEST_CASE("the shards of a layout cover every global element exactly once") {
  for (const Config& kCfg : {::kCfg, llama_cfg()})
    for (int tp : {1, 2, 4}) {
      INFO(kCfg.describe());
      const ParamLayout full(kCfg);
      std::vector<float> global(full.total());
      for (size_t i = 0; i < global.size(); ++i) global[i] = float(i) + 0.5f;
      std::vector<float> rebuilt(full.total(), -1.0f);
      std::vector<int> hits(full.total(), 0);
      for (int r = 0; r < tp; ++r) {
        const ParamLayout lay(kCfg, Placement{tp, r, {}});
        std::vector<float> mine(lay.total());
        for (const auto& t : lay.tensors()) {
          const auto& ft = full.find(t.name);
          model::copy_from_global(t, global.data() + ft.offset, mine.data() + t.offset);
          model::copy_to_global(t, mine.data() + t.offset, rebuilt.data() + ft.offset);
          for (size_t i = 0; i < t.numel; ++i) {
            const int64_t gi = t.global_index(i);
            if (gi < 0) {
              CHECK(mine[t.offset + i] == 0.0f);  // padding
              continue;
            }
            CHECK(mine[t.offset + i] == global[ft.offset + size_t(gi)]);
            if (t.replicated() ? r == 0 : true) ++hits[ft.offset + size_t(gi)];
          }
        }
      }
      INFO("tp " << tp);
      CHECK(std::memcmp(rebuilt.data(), global.data(), global.size() * sizeof(float)) == 0);
      CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
    }
  // c_attn's columns: rank 1 of 2 holds the second half of each of q, k and v.
  const ParamLayout lay(kCfg, Placement{2, 1, {}});
  const auto& attn = lay.find("h.0.attn.c_attn.weight");
  CHECK(attn.shape == std::vector<int64_t>{16, 24});
  CHECK(attn.global_index(0) == 8);                                    // row 0, q column 8
  CHECK(attn.global_index(8) == 16 + 8);                               // row 0, k column 8
  CHECK(attn.global_index(24) == 48 + 8);                              // row 1, q column 8
  CHECK(lay.find("wte.weight").shape == std::vector<int64_t>{6, 16});  // 12 padded rows / 2
  CHECK(lay.find("wte.weight").global_index(5 * 16) == -1);            // row 11: padding
  CHECK(lay.find("h.1.attn.c_proj.weight").shape == std::vector<int64_t>{8, 16});
  CHECK(lay.find("h.1.mlp.c_proj.bias").replicated());
}

TEST_CASE("every shard initialises itself to its slice of the one-process model") {
  for (const Config& kCfg : {::kCfg, llama_cfg()}) {
    INFO(kCfg.describe());
    model::OneStageModel whole(kCfg, 1, 4, 1);
    whole.init(99);
    for (int tp : {2, 4})
      for (int r = 0; r < tp; ++r) {
        model::OneStageModel part(kCfg, 1, 4, 1, Placement{tp, r, {}});
        part.init(99);
        std::vector<float> expect(part.num_params());
        for (const auto& t : part.layout().tensors())
          model::copy_from_global(t, whole.params() + whole.layout().find(t.name).offset,
                                  expect.data() + t.offset);
        INFO("tp " << tp << " rank " << r);
        CHECK(std::memcmp(expect.data(), part.params(), expect.size() * sizeof(float)) == 0);
      }
  }
}

TEST_CASE("a tensor-parallel group computes the one-process loss and gradients") {
  for (const Config& kCfg : {::kCfg, llama_cfg()}) {
    INFO(kCfg.describe());
    const int B = 2, T = 5;
    const ParamLayout full(kCfg);
    const auto global = random_global(full, 5);
    Rng rng(6);
    std::vector<int32_t> in(B * T), tg(B * T);
    for (auto& x : in) x = int32_t(rng.below(kCfg.vocab));
    for (auto& x : tg) x = int32_t(rng.below(kCfg.vocab));
    model::Stage<double> one(full, B, T);
    std::vector<double> g_one(full.total(), 0.0);
    const double loss_one = one.forward(0, global.data(), in.data(), nullptr, tg.data());
    one.backward(0, global.data(), g_one.data(), 0.1, nullptr, {});

    for (int tp : {2, 4}) {
      auto group = make_local_group(tp);
      std::vector<double> losses(tp);
      std::vector<std::vector<double>> grads(tp);
      std::vector<std::string> errors(tp);
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r)
        threads.emplace_back([&, r] {
          try {
            auto comm = std::make_shared<Communicator>(group[r]);
            tp::CommRegion region(comm);
            const ParamLayout lay(kCfg, Placement{tp, r, {}});
            const auto p = shard_of(lay, full, global);
            model::Stage<double> stage(lay, B, T, 1, &region);
            grads[r].assign(lay.total(), 0.0);
            losses[r] = stage.forward(0, p.data(), in.data(), nullptr, tg.data());
            stage.backward(0, p.data(), grads[r].data(), 0.1, nullptr, {});
          } catch (const std::exception& e) {
            errors[r] = e.what();
          }
        });
      for (auto& t : threads) t.join();
      for (int r = 0; r < tp; ++r) {
        INFO("tp " << tp << " rank " << r << ": " << errors[r]);
        REQUIRE(errors[r].empty());
        CHECK(losses[r] == Approx(loss_one).epsilon(1e-12));
        const ParamLayout lay(kCfg, Placement{tp, r, {}});
        const auto expect = shard_of(lay, full, g_one);
        double worst = 0.0;
        for (size_t i = 0; i < expect.size(); ++i) worst = std::max(worst, std::abs(expect[i] - grads[r][i]));
        CHECK(worst < 1e-12);
      }
    }
  }
}
