// The arithmetic ZeRO-2/3 build on (runtime/optim/zero.h): the compact shard's offsets (a prefix
// sum over a rank's owned slices, the layout of AdamW's state), the gather units (bucket-aligned,
// every tensor in exactly one) and the region the tied embedding pins (whole tensors and whole
// buckets), over GPT-2 (tied) and Llama (untied) layouts whole, in pipeline stages (also
// interleaved) and tensor-parallel shards. Then compact storage in the optimizer: a ZeRO-1 step
// over in-process ranks with compact gradients, or compact gradients and parameters, leaves the
// same norm, parameters and moments, bit for bit, as with whole arrays.
#include <catch2/catch.hpp>

#include <algorithm>
#include <thread>

#include "collectives/communicator.h"
#include "collectives/local_p2p.h"
#include "runtime/model/one_stage.h"
#include "runtime/optim/adamw.h"
#include "runtime/optim/zero.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/train/zero_adamw.h"
#include "runtime/train/zero_sync.h"
#include "runtime/util/random.h"

using namespace trn;

namespace {

struct Case {
  const char* what;
  model::Config cfg;
  int tp = 1, tp_rank = 0, pp = 1, pp_rank = 0, v = 1;
};

model::Config gpt2() { return model::Config{4, 4, 64, 32, 301}; }

model::Config llama() {
  model::Config c{4, 4, 64, 32, 301};
  c.arch = "llama";
  c.n_kv_head = 2;
  c.tie_embeddings = false;
  return c;
}

model::ParamLayout layout_of(const Case& c) {
  model::Placement p{c.tp, c.tp_rank, {}};
  if (c.pp > 1) p.chunks = pipeline::chunks_of(c.cfg, {c.pp, 4, c.v}, c.pp_rank);
  return model::ParamLayout(c.cfg, p);
}

// The plan the trainer builds: buckets on the norm's pieces, the tied wte cut out under pp > 1,
// and (units) the piece straddling each unit border a bucket of its own.
optim::ZeroPlan plan_of(const Case& c, const model::ParamLayout& lay, int dp, size_t bucket,
                        bool units = false) {
  std::vector<size_t> forced;
  if (const model::TensorSpec* wte = lay.tied(); wte && c.pp > 1) forced = {wte->offset, wte->offset + wte->numel};
  const std::vector<size_t> cuts = optim::norm_pieces(lay, c.tp, c.pp, c.tp_rank, c.pp_rank).cuts();
  if (units) {
    const std::vector<size_t> stops = optim::unit_stops(lay, cuts);
    forced.insert(forced.end(), stops.begin(), stops.end());
    std::sort(forced.begin(), forced.end());
    forced.erase(std::unique(forced.begin(), forced.end()), forced.end());
  }
  return optim::ZeroPlan(lay.total(), dp, bucket, cuts, forced);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const model::Config& cfg : {gpt2(), llama()}) {
    const bool g = cfg.arch == "gpt2";
    out.push_back({g ? "gpt2 whole" : "llama whole", cfg});
    out.push_back({g ? "gpt2 tp 2 rank 1" : "llama tp 2 rank 1", cfg, 2, 1});
    out.push_back({g ? "gpt2 pp 2 first stage" : "llama pp 2 first stage", cfg, 1, 0, 2, 0});
    out.push_back({g ? "gpt2 pp 2 last stage" : "llama pp 2 last stage", cfg, 1, 0, 2, 1});
    out.push_back({g ? "gpt2 interleaved pp 2 v 2 first" : "llama interleaved pp 2 v 2 first", cfg, 1, 0, 2, 0, 2});
    out.push_back({g ? "gpt2 interleaved pp 2 v 2 last" : "llama interleaved pp 2 v 2 last", cfg, 1, 0, 2, 1, 2});
    out.push_back({g ? "gpt2 tp 2 rank 0 x pp 2 last" : "llama tp 2 rank 0 x pp 2 last", cfg, 2, 0, 2, 1});
  }
  return out;
}

const size_t kBuckets[] = {1, 1000, 5000, optim::kSumChunk, size_t(1) << 24};

bool on_tensor_edge(const model::ParamLayout& lay, size_t at) {
  if (at == lay.total()) return true;
  for (const auto& t : lay.tensors())
    if (t.offset == at) return true;
  return false;
}

bool on_bucket_edge(const optim::ZeroPlan& plan, size_t at) {
  if (at == 0) return true;
  for (const auto& b : plan.buckets())
    if (b.end == at) return true;
  return false;
}

}  // namespace

TEST_CASE("zero plan: a slice's compact offset is the prefix sum of the rank's slices before it") {
  for (const Case& c : cases())
    for (int dp : {1, 2, 3, 4})
      for (size_t bucket : kBuckets) {
        INFO(c.what << ", dp " << dp << ", buckets of " << bucket);
        const auto lay = layout_of(c);
        const auto plan = plan_of(c, lay, dp, bucket);
        const size_t K = plan.buckets().size();
        size_t total = 0;
        for (int r = 0; r < dp; ++r) {
          size_t sum = 0;
          for (size_t k = 0; k < K; ++k) {
            CHECK(plan.owned_offset(k, r) == sum);
            sum += plan.slice(k, r).size();
          }
          CHECK(plan.owned_offset(K, r) == sum);
          CHECK(plan.owned_elements(r) == sum);
          total += sum;
          // The compact shard is owned(r)'s ranges one after another (AdamW's state order): the
          // element at compact position owned_offset(k, r) + i is slice(k, r).begin + i.
          std::vector<size_t> compact;
          for (const optim::Range& s : plan.owned(r))
            for (size_t i = s.begin; i < s.end; ++i) compact.push_back(i);
          REQUIRE(compact.size() == sum);
          for (size_t k = 0; k < K; ++k) {
            const optim::Range s = plan.slice(k, r);
            if (s.size()) {
              CHECK(compact[plan.owned_offset(k, r)] == s.begin);
              CHECK(compact[plan.owned_offset(k, r) + s.size() - 1] == s.end - 1);
            }
          }
          // Each norm fragment's compact position holds its first element.
          const auto pieces = optim::norm_pieces(lay, c.tp, c.pp, c.tp_rank, c.pp_rank);
          for (const auto& fs : optim::fragments(plan, pieces, r))
            for (const optim::Fragment& f : fs) {
              REQUIRE(f.at + (f.end - f.begin) <= compact.size());
              CHECK(compact[f.at] == f.begin);
              CHECK(compact[f.at + (f.end - f.begin) - 1] == f.end - 1);
            }
        }
        CHECK(total == lay.total());
      }
}

TEST_CASE("zero units: bucket-aligned, every tensor in exactly one, in buffer order") {
  for (const Case& c : cases())
    for (int dp : {1, 2, 3})
      for (size_t bucket : kBuckets)
        for (const bool stops : {false, true}) {
          INFO(c.what << ", dp " << dp << ", buckets of " << bucket
                      << (stops ? ", the trainer's unit stops" : ""));
          const auto lay = layout_of(c);
          const auto plan = plan_of(c, lay, dp, bucket, stops);
          const auto units = optim::units(lay, plan);
          REQUIRE(!units.empty());
          size_t at = 0;
          int heads = 0, embeddings = 0, blocks = 0;
          for (size_t i = 0; i < units.size(); ++i) {
            const optim::Unit& u = units[i];
            INFO("unit " << i);
            // Tiling: each unit's tensors start where the previous one's end, on tensor edges.
            CHECK(u.tensors.begin == at);
            CHECK(u.tensors.end > u.tensors.begin);
            CHECK(on_tensor_edge(lay, u.tensors.end));
            at = u.tensors.end;
            // Its buckets are exactly those overlapping its tensors, and span them.
            REQUIRE(u.first < u.last);
            REQUIRE(u.last <= plan.buckets().size());
            CHECK(plan.buckets()[u.first].begin <= u.tensors.begin);
            CHECK(plan.buckets()[u.first].end > u.tensors.begin);
            CHECK(plan.buckets()[u.last - 1].begin < u.tensors.end);
            CHECK(plan.buckets()[u.last - 1].end >= u.tensors.end);
            CHECK(u.span == optim::Range{plan.buckets()[u.first].begin, plan.buckets()[u.last - 1].end});
            CHECK(on_bucket_edge(plan, u.span.begin));
            CHECK(on_bucket_edge(plan, u.span.end));
            // Neighbours share at most the one bucket straddling their border.
            if (i) CHECK(u.first + 1 >= units[i - 1].last);
            if (i) CHECK(u.first <= units[i - 1].last);
            // With the trainer's stops that bucket is the one norm piece over the border: a unit's
            // gather reaches at most a piece past each end of its tensors, whatever the bucket size.
            if (stops) {
              CHECK(u.span.begin + optim::kSumChunk >= u.tensors.begin);
              CHECK(u.span.end <= u.tensors.end + optim::kSumChunk);
            }
            switch (u.kind) {
              case optim::Unit::Kind::kHead:
                ++heads;
                CHECK(u.tensors.end == lay.head_end);
                // The head reads the tied embedding, when this chunk holds it: the buckets over it.
                if (const model::TensorSpec* wte = lay.tied();
                    wte && wte->offset >= lay.chunk_range(u.chunk).first &&
                    wte->offset < lay.chunk_range(u.chunk).second) {
                  const auto [first, last] = plan.buckets_over(wte->offset, wte->offset + wte->numel);
                  CHECK(u.tied == plan.span(first, last));
                } else
                  CHECK(u.tied.size() == 0);
                break;
              case optim::Unit::Kind::kBlock:
                ++blocks;
                CHECK(u.tensors ==
                      optim::Range{lay.blocks[size_t(u.layer)].begin, lay.blocks[size_t(u.layer)].end});
                break;
              case optim::Unit::Kind::kEmbedding:
                ++embeddings;
                CHECK(u.tensors.end == lay.chunk_range(u.chunk).second);
                break;
            }
          }
          CHECK(at == lay.total());
          int want_heads = 0, want_embeddings = 0, want_blocks = 0;
          for (const auto& k : lay.chunks()) {
            want_heads += k.head;
            want_embeddings += k.embedding || (k.head && c.cfg.tie_embeddings);
            want_blocks += k.end_layer - k.first_layer;
          }
          CHECK(heads == want_heads);
          CHECK(embeddings == want_embeddings);
          CHECK(blocks == want_blocks);
        }
}

namespace {

// What one rank's step left: the norm, its owned parameters and moments after the update, its
// owned clipped gradients.
struct Owned {
  double norm = 0;
  std::vector<float> params, grads, m, v;
};

std::vector<float> compact_of(const std::vector<optim::Range>& owned, const float* x) {
  std::vector<float> out;
  for (const optim::Range& s : owned) out.insert(out.end(), x + s.begin, x + s.end);
  return out;
}

// Every rank of world runs forward, backward and ZeRO-1's reduce-scatter once; then, from copies
// of the same synced gradients and parameters, two ZeroAdamW updates (norm, clip to 0.5, AdamW)
// with params and grads stored as asked. Returns per rank and per storage variant what was left.
std::vector<std::vector<Owned>> zero_steps(int world, size_t bucket_bytes,
                                           const std::vector<std::pair<optim::Storage, optim::Storage>>& variants) {
  const model::Config cfg = gpt2();
  const int B = 6, T = 16;
  Rng rng(5);
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.below(cfg.vocab));
  for (auto& x : tg) x = int32_t(rng.below(cfg.vocab));
  auto group = make_local_group(world);
  std::vector<std::vector<Owned>> out(world, std::vector<Owned>(variants.size()));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto comm = std::make_shared<Communicator>(group[r]);
      const int b = B / world;
      model::OneStageModel m(cfg, b, T, 1);
      m.init(21);
      ThreadPool& pool = m.pool();
      const auto& lay = m.layout();
      const size_t n = m.num_params();
      train::ZeroSync sync(comm, n, optim::norm_pieces(lay, 1, 1, 0, 0), {.bucket_bytes = bucket_bytes});
      m.zero_grad();
      const size_t off = size_t(r) * b * T;
      m.forward_backward(in.data() + off, tg.data() + off, 1.0f / float(b * T),
                         [&](size_t begin, size_t end) { sync.grads_ready(m.grads(), begin, end); });
      sync.finish(m.grads(), n);
      const std::vector<float> params0(m.params(), m.params() + n), grads0(m.grads(), m.grads() + n);
      const auto& owned = sync.owned();
      for (size_t i = 0; i < variants.size(); ++i) {
        const auto [ps, gs] = variants[i];
        train::ZeroAdamW opt(lay, {0.9f, 0.95f, 1e-8f, 0.1f, 0.5f}, sync, nullptr);
        opt.set_storage(ps, gs);
        std::vector<float> p = ps == optim::Storage::kCompact ? compact_of(owned, params0.data()) : params0;
        std::vector<float> g;
        Owned& o = out[r][i];
        for (int step = 0; step < 2; ++step) {
          g = gs == optim::Storage::kCompact ? compact_of(owned, grads0.data()) : grads0;
          const double norm = opt.grad_norm(g.data(), pool);
          if (step == 0) o.norm = norm;
          CHECK(norm == o.norm);  // the same gradients each time
          opt.update(p.data(), g.data(), norm, 1e-3f, pool);
        }
        o.params = ps == optim::Storage::kCompact ? p : compact_of(owned, p.data());
        o.grads = gs == optim::Storage::kCompact ? g : compact_of(owned, g.data());
        o.m = opt.m();
        o.v = opt.v();
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

TEST_CASE("zero unit stops: both cuts around every unit border, so no unit gathers its neighbour's bucket") {
  // Blocks of about 197k elements (d_model 128), three norm pieces each, under buckets larger
  // than a block: without the cut before each border, every block's gather would hold the whole
  // previous block (the bucket that ends one piece past the border).
  const model::Config cfg{4, 4, 128, 32, 301};
  const model::ParamLayout lay(cfg);
  const std::vector<size_t> cuts = optim::norm_pieces(lay, 1, 1, 0, 0).cuts();
  const std::vector<size_t> stops = optim::unit_stops(lay, cuts);
  REQUIRE(!stops.empty());
  CHECK(std::is_sorted(stops.begin(), stops.end()));
  CHECK(std::adjacent_find(stops.begin(), stops.end()) == stops.end());
  for (size_t s : stops) CHECK(std::binary_search(cuts.begin(), cuts.end(), s));
  std::vector<size_t> borders{lay.chunk_range(0).first, lay.head_end};
  for (const model::ParamLayout::Block& b : lay.blocks) borders.push_back(b.end);
  for (size_t b : borders) {
    INFO("border " << b);
    const auto up = std::lower_bound(cuts.begin(), cuts.end(), b);
    CHECK(std::binary_search(stops.begin(), stops.end(), *up));
    if (*up != b) CHECK(std::binary_search(stops.begin(), stops.end(), *(up - 1)));
  }
  for (int dp : {2, 3})
    for (size_t bucket : {size_t(100000), size_t(1) << 24}) {
      INFO("dp " << dp << ", buckets of " << bucket);
      const optim::ZeroPlan plan(lay.total(), dp, bucket, cuts, stops);
      for (const optim::Unit& u : optim::units(lay, plan)) {
        CHECK(u.span.begin + optim::kSumChunk >= u.tensors.begin);
        CHECK(u.span.end <= u.tensors.end + optim::kSumChunk);
      }
    }
}

TEST_CASE("zero compact storage: a ZeRO-1 step with compact grads and params equals the whole one bit for bit") {
  using S = optim::Storage;
  const std::vector<std::pair<S, S>> variants = {
      {S::kWhole, S::kWhole}, {S::kWhole, S::kCompact}, {S::kCompact, S::kCompact}};
  for (int dp : {2, 3})
    for (size_t bucket : {size_t(4096), size_t(1) << 20}) {
      INFO("dp " << dp << ", buckets of " << bucket << " bytes");
      const auto got = zero_steps(dp, bucket, variants);
      for (int r = 0; r < dp; ++r) {
        const Owned& whole = got[r][0];
        REQUIRE(whole.norm > 0.5);  // clipping scaled the gradients
        REQUIRE(!whole.params.empty());
        for (size_t i = 1; i < variants.size(); ++i) {
          INFO("rank " << r << ", variant " << i);
          CHECK(got[r][i].norm == whole.norm);
          CHECK(got[r][i].grads == whole.grads);
          CHECK(got[r][i].params == whole.params);
          CHECK(got[r][i].m == whole.m);
          CHECK(got[r][i].v == whole.v);
        }
      }
    }
}
