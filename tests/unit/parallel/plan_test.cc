// The parallel plan without a network: rank placement, the shard/replicate split, the one-line
// refusals, the names parsed into enums, and the one memory count, which the trainer's check
// and trn-plan's prediction both report for the same layout.
#include "runtime/parallel/plan.h"

#include <catch2/catch.hpp>

#include <set>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/model/config.h"
#include "runtime/plan/cluster.h"
#include "runtime/plan/plan.h"
#include "runtime/train/builder.h"
#include "runtime/train/options.h"

using namespace trn;
using Catch::Matchers::Contains;
using parallel::Coords;
using parallel::GradWire;
using parallel::Plan;
using parallel::Schedule;

namespace {

// The tiny GPT-2 with 4 layers (2 pipeline stages of 2 chunks each).
model::Config four_layers() {
  model::Config c = model::preset("tiny");
  c.n_layer = 4;
  return c;
}

Plan plan_of(int dp, int tp, int pp) {
  Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  return p;
}

// The usage error check() throws, or "" when it accepts the plan.
std::string refusal(const Plan& p, const model::Config& c, int batch, int seq_len = 0) {
  try {
    parallel::check(p, c, batch, "--dp", seq_len);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  return "";
}

train::Options options(std::vector<std::string> args) {
  train::Options o;
  REQUIRE(train::parse_options(args, &o));
  return o;
}

// A local cluster (this machine's kind) with a measured process base of 100 MB.
plan::Cluster local_cluster() {
  plan::Cluster c;
  c.local = true;
  c.name = "local";
  c.nodes = 1;
  c.cpu_cores = 64;
  c.host_memory_bytes = 1e12;
  c.calibration.base_rss_bytes = c.calibration.base_rss_single_bytes = c.calibration.base_rss_network_bytes = 1e8;
  c.calibration.seq_len = 32;
  for (int tp : {1, 2})
    for (int b : {1, 2, 4, 8}) c.calibration.pieces[tp][b].block_fwd = 1e-3 * b;
  return c;
}

}  // namespace

TEST_CASE("the plan places rank = (pp * dp + dp_rank) * tp + tp_rank for every dp x tp x pp") {
  for (const auto& [dp, tp, pp] : std::vector<std::tuple<int, int, int>>{
           {1, 1, 1}, {2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 2}, {3, 2, 4}, {4, 1, 2}, {1, 4, 3}}) {
    const Plan p = plan_of(dp, tp, pp);
    INFO(p.flags());
    REQUIRE(p.world() == dp * tp * pp);
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < p.world(); ++r) {
      const Coords c = p.coords_of(r);
      CHECK(r == (c.pp * dp + c.dp) * tp + c.tp);
      CHECK(p.rank_of(c) == r);
      CHECK(c.dp < dp);
      CHECK(c.tp < tp);
      CHECK(c.pp < pp);
      seen.insert({c.dp, c.tp, c.pp});
    }
    CHECK(int(seen.size()) == p.world());  // every coordinate once
    // A tensor-parallel group is tp consecutive ranks; the pipeline is outermost.
    std::vector<int> first_tp_group;  // ranks 0 .. tp-1
    for (int t = 0; t < tp; ++t) first_tp_group.push_back(t);
    CHECK(p.grid().tp_group(0) == first_tp_group);
    CHECK(p.coords_of(p.world() - 1) == Coords{dp - 1, tp - 1, pp - 1});
    CHECK(p.pipeline().P == pp);
  }
}

TEST_CASE("the plan's data-parallel split: ZeRO-1 shards over every replica, else each replicates") {
  Plan p = plan_of(4, 2, 1);
  CHECK(p.dp_shard() == 1);
  CHECK(p.dp_replicate() == 4);
  CHECK_FALSE(p.sharded());
  p.zero = 1;
  CHECK(p.dp_shard() == 4);
  CHECK(p.dp_replicate() == 1);
  CHECK(p.sharded());
  // One replica has nothing to shard: it trains as ZeRO 0.
  Plan one = plan_of(1, 2, 2);
  one.zero = 1;
  CHECK(one.dp_shard() == 1);
  CHECK(one.dp_replicate() == 1);
  CHECK_FALSE(one.sharded());
}

TEST_CASE("the plan's micro-batches, shapes and placement") {
  const model::Config c = four_layers();
  Plan p = plan_of(2, 1, 2);
  p.micro_batches = 4;
  p.virtual_stages = 2;
  p.schedule = Schedule::kInterleaved;
  CHECK(p.micro_batch(16) == 2);
  CHECK(p.pipeline().M == 4);
  CHECK(p.pipeline().V == 2);
  CHECK(p.pipeline().virtual_stages() == 4);
  const model::Placement place = p.placement(c, 0, 1);
  CHECK(place.tp == 1);
  REQUIRE(place.chunks.size() == 2);
  CHECK_FALSE(place.chunks[0].embedding);
  CHECK(place.chunks[1].head);
  CHECK(plan_of(1, 2, 1).placement(c, 1, 0).chunks.empty());  // one stage holds every block
  CHECK(p.flags() == "--dp 2 --tp 1 --pp 2 --micro-batches 4 --schedule interleaved --virtual-stages 2");
}

TEST_CASE("a plan the model or batch cannot take is refused in one line") {
  const model::Config c = four_layers();  // 4 heads, 4 layers
  CHECK(refusal(plan_of(2, 2, 2), c, 8).empty());
  Plan with_cp = plan_of(2, 2, 1);
  with_cp.cp = 4;
  CHECK(refusal(with_cp, c, 8, 64).empty());
  Plan p = plan_of(1, 3, 1);
  CHECK_THAT(refusal(p, c, 8), Contains("does not divide n_head"));
  p = plan_of(3, 1, 1);
  CHECK_THAT(refusal(p, c, 8), Contains("--batch-size 8 must divide evenly into --dp 3 x --micro-batches 1"));
  p = plan_of(1, 1, 2);
  p.virtual_stages = 2;
  CHECK_THAT(refusal(p, c, 8), Contains("--virtual-stages 2 needs --schedule interleaved"));
  p = plan_of(1, 1, 1);
  p.virtual_stages = 2;
  CHECK_THAT(refusal(p, c, 8), Contains("need --pp 2 or more"));
  p = plan_of(1, 1, 1);
  p.schedule = Schedule::kZeroBubble;
  CHECK_THAT(refusal(p, c, 8), Contains("need --pp 2 or more"));
  p = plan_of(1, 1, 8);
  CHECK_THAT(refusal(p, c, 8), Contains("makes 8 pipeline chunks but the model has 4 layers"));
  p = plan_of(1, 1, 2);
  p.schedule = Schedule::kInterleaved;
  p.virtual_stages = 2;
  p.micro_batches = 3;
  CHECK_THAT(refusal(p, c, 6), Contains("--micro-batches"));
  p = plan_of(2, 1, 1);
  p.zero = 4;
  CHECK_THAT(refusal(p, c, 8), Contains("--zero 4: ZeRO stages are 0 to 3"));
  p = plan_of(4, 1, 1);
  p.zero = 1;
  p.shard_group = 3;
  CHECK_THAT(refusal(p, c, 8), Contains("--shard-group 3 must divide the 4 data-parallel ranks"));
  p.shard_group = 2;
  CHECK(refusal(p, c, 8).empty());
  CHECK(p.dp_shard() == 2);
  CHECK(p.dp_replicate() == 2);
  p = plan_of(1, 1, 1);
  p.tp = 0;
  CHECK_THAT(refusal(p, c, 8), Contains("at least 1"));
  // What comes next holds its only value today; a sequence that does not cut into 2 cp chunks
  // (or, under sequence parallelism, whose cp chunks do not split over tp) is refused.
  for (int which = 0; which < 7; ++which) {
    Plan q = plan_of(2, 1, 1);
    int seq_len = 0;
    if (which == 0) q.sequence_parallel = true;
    if (which == 1) q.cp = 2, seq_len = 30;
    if (which == 2) q.ep = 2;
    if (which == 3) q.shard_group = 2;
    if (which == 4) q.zero = -1;
    if (which == 5) q.cp = 0;
    if (which == 6) q.cp = 2, q.tp = 4, q.sequence_parallel = true, seq_len = 20;  // 10 tokens per cp rank
    INFO(which);
    const std::string why = refusal(q, c, 8, seq_len);
    if (which == 1) CHECK_THAT(why, Contains("multiple of 4"));
    if (which == 6) CHECK_THAT(why, Contains("10 tokens per rank"));
    CHECK_FALSE(why.empty());
    CHECK(why.find('\n') == std::string::npos);
  }
  for (const Plan& bad : {plan_of(3, 1, 1), plan_of(1, 3, 1), plan_of(1, 1, 8)})
    CHECK(refusal(bad, c, 8).find('\n') == std::string::npos);
}

TEST_CASE("schedule and wire names are parsed into the plan's enums where options are parsed") {
  for (Schedule s : {Schedule::kGpipe, Schedule::k1F1B, Schedule::kInterleaved, Schedule::kZeroBubble})
    CHECK(pipeline::parse_kind(pipeline::to_string(s)) == s);
  CHECK(pipeline::parse_kind("zb") == Schedule::kZeroBubble);
  CHECK_THROWS_WITH(pipeline::parse_kind("zero-bubble"),
                    Contains("unknown --schedule 'zero-bubble': use gpipe, 1f1b, interleaved or zb"));
  for (GradWire w : {GradWire::kF32, GradWire::kBF16, GradWire::kFP8})
    CHECK(parallel::parse_grad_wire(parallel::to_string(w)) == w);
  CHECK(parallel::parse_grad_wire("fp32") == GradWire::kF32);
  CHECK_THROWS_WITH(parallel::parse_grad_wire("fp16"), Contains("--grad-comm takes f32, bf16 or fp8, got 'fp16'"));

  const train::Options o = options({"--pp", "2", "--schedule", "zb", "--micro-batches", "4", "--dp", "2", "--zero",
                                    "1", "--grad-comm", "bf16", "--bucket-mb", "2", "--batch-size", "16"});
  CHECK(o.plan.schedule == Schedule::kZeroBubble);
  CHECK(o.plan.grad_wire == GradWire::kBF16);
  CHECK(o.plan.pp == 2);
  CHECK(o.plan.micro_batches == 4);
  CHECK(o.plan.dp_shard() == 2);
  CHECK(o.plan.bucket_bytes() == size_t(2) << 20);
  CHECK(o.plan.flags() == "--dp 2 --tp 1 --pp 2 --micro-batches 4 --schedule zb --zero 1 --bucket-mb 2 --grad-comm bf16");
  train::Options bad;
  CHECK_THROWS_WITH(train::parse_options({"--pp", "2", "--schedule", "fast"}, &bad), Contains("unknown --schedule 'fast'"));
  CHECK_THROWS_WITH(train::parse_options({"--grad-comm", "int8"}, &bad), Contains("--grad-comm takes f32, bf16 or fp8"));
  // Without --dp the replicas fill the job.
  train::Options fill = options({"--tp", "2", "--batch-size", "8"});
  train::resolve_layout(&fill, 8);
  CHECK(fill.plan.dp == 4);
}

TEST_CASE("the memory count is the one the trainer's check and trn-plan report for the same layout") {
  const plan::Cluster cl = local_cluster();
  const std::vector<std::vector<std::string>> layouts = {
      {},
      {"--threads", "2"},
      {"--threads", "3", "--micro-batches", "2"},
      {"--dp", "2", "--zero", "1"},
      {"--dp", "2", "--grad-comm", "bf16"},
      {"--tp", "2"},
      {"--pp", "2", "--micro-batches", "4"},
      {"--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"},
      {"--pp", "2", "--micro-batches", "4", "--schedule", "zb", "--dp", "2", "--zero", "1"},
      {"--pp", "2", "--micro-batches", "4", "--schedule", "interleaved", "--virtual-stages", "2", "--tp", "2"},
      {"--precision", "bf16", "--dp", "2"},
      {"--precision", "bf16", "--pp", "2", "--micro-batches", "2", "--threads", "2"},
      // A mixture of experts (mixtral-tiny, 4 experts): each rank holds n_experts / ep of them.
      {"--model", "mixtral-tiny"},
      {"--model", "mixtral-tiny", "--dp", "2", "--ep", "2"},
      {"--model", "mixtral-tiny", "--dp", "4", "--ep", "4", "--tp", "2", "--precision", "bf16"},
      {"--model", "mixtral-tiny", "--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2"},
  };
  for (const auto& extra : layouts) {
    std::vector<std::string> args = {"--model", "tiny", "--n-layer", "4", "--batch-size", "8", "--seq-len", "32"};
    if (!extra.empty() && extra[0] == "--model") args = {"--batch-size", "8", "--seq-len", "32"};
    args.insert(args.end(), extra.begin(), extra.end());
    train::Options o = options(args);
    train::resolve_layout(&o, o.plan.world());
    std::string name;
    for (const auto& a : extra) name += a + " ";
    INFO(name);
    plan::Job job;
    job.model = o.model;
    job.global_batch = o.batch_size;
    job.seq_len = o.seq_len;
    job.threads = o.threads;
    const plan::Prediction p = plan::predict(job, o.plan, cl);
    REQUIRE(p.runs);
    const parallel::MemoryCount check = train::memory_need(o, 0);
    // trn-plan adds the process's measured base (and a pair of 1 MiB shared-memory rings for each
    // same-host peer beyond the one the base was measured with); everything else is the same count.
    const double rings = 2.0 * ((1 << 20) + 3 * 64) * std::max(0, o.plan.world() - 2);
    CHECK(p.memory.base == Approx(1e8 + rings));
    CHECK(check.base == 0);
    CHECK(p.memory.weights == check.weights);
    CHECK(p.memory.gradients == check.gradients);
    CHECK(p.memory.optimizer == check.optimizer);
    CHECK(p.memory.bf16_copy == check.bf16_copy);
    CHECK(p.memory.activations == check.activations);
    CHECK(p.memory.buffers == check.buffers);
    CHECK(p.memory.total() == Approx(check.total() + 1e8 + rings));
    CHECK(check.total() > 0);
    // The direct count over each tensor-parallel rank is the same (every rank holds as much).
    if (o.plan.tp > 1) CHECK(train::memory_need(o, 1).total() == check.total());
    // So is every expert-parallel rank's: each holds n_experts / ep experts.
    if (o.plan.ep > 1) {
      parallel::StageCounter direct;
      for (int r = 1; r < o.plan.ep; ++r)
        CHECK(direct.params(o.model, o.plan.placement(o.model, 0, 0, 0, r)).total ==
              direct.params(o.model, o.plan.placement(o.model, 0, 0)).total);
    }
  }
}

TEST_CASE("the memory count holds a rank's n_experts / ep experts, and ZeRO shards over their holders") {
  // mixtral-tiny: 2 MoE layers of 4 experts. Whole, and its experts' share of it.
  model::Config c = model::preset("mixtral-tiny");
  const model::ParamLayout whole(c);
  double experts = 0;
  for (const model::TensorSpec& t : whole.tensors())
    if (parallel::is_expert(t.name)) experts += double(t.numel);
  CHECK(experts == 2 * 4 * 3 * 64 * 96);  // layers x experts x (w1, w2, w3) x C x F
  CHECK_FALSE(parallel::is_expert("model.layers.0.block_sparse_moe.gate.weight"));  // the router: replicated
  const double P = double(whole.total());
  auto at = [&](int dp, int ep, int zero = 0, int shard_group = 0) {
    Plan p = plan_of(dp, 1, 1);
    p.ep = ep;
    p.zero = zero;
    p.shard_group = shard_group;
    return parallel::memory(p, c, 8, 32);  // (memory() does not check: ZeRO with ep is counted as it would run)
  };
  for (int ep : {1, 2, 4}) {
    INFO("ep " << ep);
    const parallel::MemoryCount m = at(4, ep);
    CHECK(m.weights == 4 * (P - experts + experts / ep));
    CHECK(m.gradients == m.weights);
    CHECK(m.optimizer == 2 * m.weights);
  }
  // Under expert parallelism ZeRO shards over the replicas holding the same experts (dp / ep of
  // them), the dense state and the rank's experts alike; at dp = ep there is nothing to shard.
  Plan p = plan_of(8, 1, 1);
  p.zero = 1;
  p.ep = 2;
  CHECK(p.dp_shard() == 4);
  CHECK(p.expert_shard() == 4);
  CHECK(p.dp_replicate() == 2);
  p.ep = 8;
  CHECK_FALSE(p.sharded());
  for (int ep : {1, 2, 4}) {
    INFO("ep " << ep);
    const double held = P - experts + experts / ep;
    CHECK(at(4, ep, 1).optimizer == Approx(8 * held / (4 / ep)));
  }
  CHECK(at(4, 1, 1, 2).optimizer == Approx(8 * P / 2));
  const double held = P - experts + experts / 2;
  CHECK(at(4, 2, 3).weights == Approx(4 * held / 2));
  CHECK(at(4, 2, 3).weights == Approx(at(4, 2, 0).weights / 2));
}

TEST_CASE("the memory count holds the MoE layer's routing, padded expert rows and expert-parallel exchange") {
  // mixtral-tiny: 2 MoE layers, C 64, F 96, 4 experts, top-2. dp 4 at batch 8 x 32: N = 64 tokens
  // per rank, N x k = 128 grouped rows.
  const model::Config c = model::preset("mixtral-tiny");
  auto at = [&](int ep, model::Precision precision) {
    model::Config m = c;
    m.precision = precision;
    Plan p = plan_of(4, 1, 1);
    p.ep = ep;
    return parallel::memory(p, m, 8, 32);
  };
  const double N = 64, k = 2, C = 64, F = 96, layers = 2;
  // Under full precision in fp32, four padded buffers of an expert's balanced load (N k / El
  // rows, to a multiple of 32): two of max(C, F) and two of max(2F, C) floats.
  auto padding = [&](double rows) { return 4 * rows * (2 * F + 2 * 2 * F); };
  // Under ep 2 each token goes to at most min(k, 2) = 2 ranks: 128 rows sent, as many received.
  const double sent = N * 2;
  // Per layer the dispatch's plan: 2 + 2 row counts, per sent row its token, per (row, choice)
  // the choice, the local expert, its weight and grouped row, the 2 + 1 offsets and the 128
  // grouped rows' received rows (4 bytes each).
  const double dispatch = 4 * (2 + 2 + sent + 4 * sent * k + 3 + N * k);
  // The exchanges' rows (once per stage): out and in of C + 2k, back of C + k.
  const double wire = 4 * sent * (2 * (C + 2 * k) + 2 * (C + k));
  const double fp32 = at(2, model::Precision::kFp32).activations - at(1, model::Precision::kFp32).activations;
  CHECK(fp32 == layers * dispatch + wire + padding(64) - padding(32));
  // bf16 pads nothing.
  const double bf16 = at(2, model::Precision::kBf16).activations - at(1, model::Precision::kBf16).activations;
  CHECK(bf16 == layers * dispatch + wire);
  // The routing is counted without ep too: per choice 4 vectors of 4 bytes, per token its norm,
  // the E + 1 offsets, per sequence (B = 2) each expert's count. Against a Llama of the same
  // shape, the MoE layer's every other buffer differs too, so check the bytes by difference in
  // k: top-1 holds (N x 1) choices fewer of everything per-choice.
  model::Config one = c;
  one.top_k = 1;
  Plan p = plan_of(4, 1, 1);
  const double per_choice = parallel::memory(p, c, 8, 32).activations - parallel::memory(p, one, 8, 32).activations;
  // Per layer and choice: xs, ys (C), hs (2F) and the routing's 4; the scratch's 2C + 4F and its
  // dweight (per token and choice); the padding of 32 rows either way (N k / E = 32, 16 -> 32).
  CHECK(per_choice == N * (layers * 4 * (C + C + 2 * F + 4) + 4 * (2 * C + 4 * F + 1)));
}

TEST_CASE("the memory count follows ZeRO's shard, the schedule's live micro-batches and the threads") {
  const model::Config c = four_layers();
  const Plan one = plan_of(1, 1, 1);
  Plan zero = plan_of(2, 1, 1);
  zero.zero = 1;
  const parallel::MemoryCount a = parallel::memory(one, c, 8, 32), z = parallel::memory(zero, c, 8, 32);
  CHECK(z.optimizer == a.optimizer / 2);  // AdamW's moments split over 2 replicas
  CHECK(z.weights == a.weights);
  CHECK(a.optimizer == 2 * a.weights);  // two moments a parameter
  Plan gpipe = plan_of(1, 1, 2), f1b = plan_of(1, 1, 2);
  gpipe.micro_batches = f1b.micro_batches = 4;
  gpipe.schedule = Schedule::kGpipe;
  CHECK(parallel::memory(gpipe, c, 8, 32).activations > parallel::memory(f1b, c, 8, 32).activations);
  parallel::MemoryInputs two;
  two.threads = 2;
  const parallel::MemoryCount t = parallel::memory(one, c, 8, 32, two);
  CHECK(t.gradients == 2 * a.gradients);  // the second thread's own gradient buffer
  // ZeRO-2 adds the owned gradient shard copied out of the whole accumulator; ZeRO-3 keeps 1/dp
  // of the weights, holds no bf16 copy between pieces and gathers units instead.
  Plan z2 = zero, z3 = zero;
  z2.zero = 2;
  z3.zero = 3;
  const parallel::MemoryCount m2 = parallel::memory(z2, c, 8, 32), m3 = parallel::memory(z3, c, 8, 32);
  CHECK(m2.weights == z.weights);
  // One backward per step: the gradient window instead of the whole accumulator (with buckets
  // well below the model's size: a bucket's copy is in flight beside the window).
  Plan z1s = zero, z2s = z2;
  z1s.bucket_mb = z2s.bucket_mb = 0.05;
  CHECK(parallel::memory(z2s, c, 8, 32).gradients < parallel::memory(z1s, c, 8, 32).gradients);
  // Two: the whole accumulator, and the shard copied out of it.
  Plan z1m = zero, z2m = z2;
  z1m.micro_batches = z2m.micro_batches = 2;
  CHECK(parallel::memory(z2m, c, 8, 32).gradients == parallel::memory(z1m, c, 8, 32).gradients * 1.5);
  CHECK(m3.weights == z.weights / 2);
  CHECK(m3.optimizer == z.optimizer);
  CHECK(m3.buffers > z.buffers);
  // A shard group of 1 out of 2 replicas shards nothing: as ZeRO-0 at the same dp.
  Plan hybrid = z3;
  hybrid.shard_group = 1;
  CHECK(parallel::memory(hybrid, c, 8, 32).total() == parallel::memory(plan_of(2, 1, 1), c, 8, 32).total());
}
