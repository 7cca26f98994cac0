// The planner's parts without a cluster: the tensor-parallel calls it charges are the ones the
// model's bodies make, the event simulation of a step reproduces each schedule's bubble and the
// data-parallel overlap, memory is the layout's own count, and cluster files load (or fail with
// one line).
#include "runtime/plan/plan.h"

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "collectives/core/error.h"
#include "runtime/model/config.h"
#include "runtime/model/stage.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/pipeline_parallel/schedule.h"
#include "runtime/plan/calibrate.h"
#include "runtime/plan/cluster.h"

using namespace trn;
using Catch::Matchers::Contains;

namespace {

std::string clusters() { return std::string(TRN_SOURCE_DIR) + "/deploy/clusters"; }

// A local cluster whose calibration times every piece alike: forward 1 ms per block.
plan::Cluster flat_local(int hosts, int cores) {
  plan::Cluster c;
  c.local = true;
  c.name = "local";
  c.nodes = hosts;
  c.cpu_cores = cores;
  c.host_memory_bytes = 64.0 * (1 << 30);
  c.links = CostModel{params_for_transport("shm"), params_for_transport("tcp")};
  for (int tp : {1, 2, 4})
    for (int b : {1, 2, 4, 8}) {
      plan::PieceTimes t;
      t.block_fwd = 1e-3 * b / tp;
      t.block_bwd = 2e-3 * b / tp;
      t.block_bwd_input = 1e-3 * b / tp;
      t.block_bwd_weight = 1e-3 * b / tp;
      t.embedding_fwd = t.embedding_bwd = 1e-4 * b;
      t.head_fwd = 1e-3 * b / tp;
      t.head_bwd = 2e-3 * b / tp;
      c.calibration.pieces[tp][b] = t;
    }
  c.calibration.seq_len = 64;
  c.calibration.adamw_s_per_param = 1e-9;
  c.calibration.norm_s_per_param = 1e-10;
  c.calibration.copy_bytes_per_s = 1e10;
  return c;
}

plan::Job tiny_job(int batch) {
  plan::Job j;
  j.model = model::preset("tiny");
  j.global_batch = batch;
  j.seq_len = 64;
  return j;
}

// mixtral-tiny: 2 layers of 4 experts (ffn 96), top 2, d_model 64.
plan::Job moe_job(int batch) {
  plan::Job j = tiny_job(batch);
  j.model = model::preset("mixtral-tiny");
  return j;
}

// The prediction of --dp dp --ep ep, which must run.
plan::Prediction predict_ep(const plan::Job& j, const plan::Cluster& cl, int dp, int ep) {
  plan::Layout l;
  l.dp = dp;
  l.ep = ep;
  const plan::Prediction p = plan::predict(j, l, cl);
  REQUIRE(p.runs);
  return p;
}

}  // namespace

TEST_CASE("the tensor-parallel calls the plan charges are the ones the bodies make, with and without sequence "
          "parallelism") {
  for (const char* name : {"tiny", "llama-tiny"})
    for (const bool seq : {false, true}) {
    model::Config c = model::preset(name);
    c.n_layer = 2;
    c.sequence_parallel = seq;
    const int B = 2, T = 16;
    std::vector<std::pair<std::string, std::vector<plan::TpCall>>> calls;
    plan::time_pieces(c, 2, B, T, 1, &calls);
    const plan::TpCalls want = plan::tp_calls(c, size_t(B) * T);
    std::map<std::string, std::vector<plan::TpCall>> got(calls.begin(), calls.end());
    INFO(name << (seq ? " --sequence-parallel" : ""));
    CHECK(got["embedding_fwd"] == want.embedding_fwd);
    CHECK(got["embedding_bwd"] == want.embedding_bwd);
    CHECK(want.embedding_bwd.empty() == !seq);
    CHECK(got["block_fwd"] == want.block_fwd);
    CHECK(got["block_bwd"] == want.block_bwd);
    CHECK(got["head_fwd"] == want.head_fwd);
    CHECK(got["head_bwd"] == want.head_bwd);
    }
}

TEST_CASE("with equal forwards and backwards the simulated step has each schedule's bubble") {
  for (const char* sched : {"gpipe", "1f1b", "interleaved", "zb"})
    for (int P : {2, 4})
      for (int M : {4, 8, 16}) {
        plan::StepInput in;
        in.schedule = pipeline::parse_kind(sched);
        in.P = P;
        in.M = M;
        in.V = std::string(sched) == "interleaved" ? 2 : 1;
        in.n_layer = P * in.V;
        const bool zb = std::string(sched) == "zb";
        in.cost.block_fwd = 1;
        in.cost.block_bwd = zb ? 2 : 1;
        in.cost.block_bwd_input = 1;
        in.cost.block_bwd_weight = 1;
        const plan::StepResult r = plan::simulate_step(in);
        const double work = M * in.V * (zb ? 3.0 : 2.0);
        INFO(sched << " P " << P << " M " << M);
        // Every stage computes the same; the idle share of the slowest is the bubble.
        for (double b : r.busy_s) CHECK(b == Approx(work));
        const double share = r.bubble_s / r.step_s;
        const double theory = pipeline::theoretical_bubble(pipeline::parse_kind(sched), {P, M, in.V});
        CHECK(r.step_s == Approx(r.busy_s[0] + r.bubble_s));
        if (std::string(sched) == "gpipe" || std::string(sched) == "1f1b")
          CHECK(share == Approx(theory));
        else
          CHECK(share == Approx(theory).margin(0.06));
      }
}

TEST_CASE("a transfer between stages delays the step, and buckets overlap the backward") {
  plan::StepInput in;
  in.P = 2;
  in.M = 4;
  in.n_layer = 2;
  in.cost.block_fwd = 1;
  in.cost.block_bwd = 2;
  const double base = plan::simulate_step(in).step_s;
  in.transfer_s = 0.25;
  CHECK(plan::simulate_step(in).step_s > base);

  plan::StepInput one;
  one.n_layer = 4;
  one.cost.block_fwd = 1;
  one.cost.block_bwd = 2;
  // A bucket that the last block's backward finishes hides behind the blocks after it; the one
  // the embedding finishes is exposed whole.
  one.buckets = {{{3, 4.0}}};
  CHECK(plan::simulate_step(one).dp_exposed_s == Approx(0.0));
  one.buckets = {{{3, 4.0}, {-1, 1.5}}};
  CHECK(plan::simulate_step(one).dp_exposed_s == Approx(1.5 + 0.0));
  one.buckets = {{{3, 7.0}, {-1, 1.5}}};
  CHECK(plan::simulate_step(one).dp_exposed_s == Approx(1.0 + 1.5));  // 2 + 7 ends 1 after the backward
}

TEST_CASE("memory per rank is the layout's parameters, AdamW's state and the stage's activations") {
  const plan::Cluster cl = flat_local(1, 8);
  const plan::Job job = tiny_job(8);
  plan::Layout one;
  const plan::Prediction p = plan::predict(job, one, cl);
  const model::ParamLayout lay(job.model);
  CHECK(p.memory.weights == 4.0 * lay.total());
  CHECK(p.memory.gradients == 4.0 * lay.total());
  CHECK(p.memory.optimizer == 8.0 * lay.total());
  CHECK(p.memory.activations == double(model::Stage<float>::activation_bytes(lay, 8, 64, 1)));
  plan::Layout zero;
  zero.dp = 2;
  zero.zero = 1;
  const plan::Prediction z = plan::predict(job, zero, cl);
  CHECK(z.memory.optimizer == 4.0 * lay.total());  // AdamW's moments split over 2 replicas
  CHECK(z.memory.activations == double(model::Stage<float>::activation_bytes(lay, 4, 64, 1)));
  plan::Layout pipe;
  pipe.pp = 2;
  pipe.micro_batches = 4;
  pipe.schedule = parallel::Schedule::kGpipe;
  const plan::Prediction g = plan::predict(job, pipe, cl);
  pipe.schedule = parallel::Schedule::k1F1B;
  const plan::Prediction f = plan::predict(job, pipe, cl);
  CHECK(g.memory.activations > f.memory.activations);  // GPipe keeps all 4 micro-batches
}

TEST_CASE("a layout trn-train refuses is not run, with trn-train's reason") {
  const plan::Cluster cl = flat_local(1, 8);
  plan::Layout l;
  l.tp = 3;
  const plan::Prediction p = plan::predict(tiny_job(8), l, cl);
  CHECK_FALSE(p.runs);
  CHECK_THAT(p.why_not, Contains("does not divide n_head"));
  plan::Layout m;
  m.dp = 3;
  CHECK_FALSE(plan::predict(tiny_job(8), m, cl).runs);
}

TEST_CASE("link delay between hosts slows data-parallel and pipeline layouts, not one-host ones") {
  const plan::Job job = tiny_job(8);
  plan::Cluster near = flat_local(2, 8), far = flat_local(2, 8);
  far.delay_s = 5e-3;
  for (plan::Layout l : {plan::Layout{2, 1, 1}, plan::Layout{1, 1, 2, 4}}) {
    INFO(l.flags());
    CHECK(plan::predict(job, l, far).step_s > plan::predict(job, l, near).step_s);
  }
}

TEST_CASE("calibrated times are interpolated linearly in the micro-batch") {
  plan::Calibration c;
  plan::PieceTimes a, b;
  a.block_fwd = 1;
  b.block_fwd = 5;
  c.pieces[1][2] = a;
  c.pieces[1][4] = b;
  CHECK(c.at(1, 3).block_fwd == Approx(3));
  CHECK(c.at(1, 8).block_fwd == Approx(13));  // beyond: the last two sizes' slope
  CHECK(c.at(1, 1).block_fwd == 0);           // the slope would give -1: clamped at 0
  CHECK_FALSE(c.has_tp(2));
}

TEST_CASE("cluster files load; a bad spec or file is one usage error") {
  const plan::Cluster trn2 = plan::load_cluster("trn2.48xlarge:4", clusters());
  CHECK(trn2.world() == 64);
  CHECK(trn2.device_memory_bytes > 0);
  CHECK(trn2.matmul_flops_bf16 > trn2.matmul_flops_fp32);
  for (const char* name : {"trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"})
    CHECK_NOTHROW(plan::load_cluster(std::string(name) + ":1", clusters()));
  CHECK_THROWS_WITH(plan::load_cluster("trn2.48xlarge", clusters()), Contains("expected"));
  CHECK_THROWS_WITH(plan::load_cluster("trn2.48xlarge:zero", clusters()), Contains("positive integer"));
  CHECK_THROWS_WITH(plan::load_cluster("p5.48xlarge:2", clusters()), Contains("known: trn1.32xlarge"));
  CHECK_THROWS_WITH(plan::load_cluster("local:/nonexistent/file.json", clusters()), Contains("calibrate"));

  const std::string dir = std::filesystem::temp_directory_path() / "trn_plan_test";
  std::filesystem::create_directories(dir);
  const plan::Cluster flat = flat_local(1, 8);
  plan::save_local_cluster(dir + "/here.json", flat.calibration, 8, 64.0 * (1 << 30));
  const plan::Cluster back = plan::load_cluster("local:" + dir + "/here.json", clusters());
  CHECK(back.local);
  CHECK(back.cpu_cores == 8);
  CHECK(back.calibration.at(2, 4).block_fwd == Approx(2e-3));
  // A real step's scale multiplies every piece at every size (measured or between); it, the busy
  // scale and the oversubscribed latency round-trip through the file, and a scale that is not
  // positive is refused by name.
  plan::Calibration scaled = flat.calibration;
  scaled.step_scale = 1.25;
  scaled.busy_scale = 1.1;
  scaled.oversubscribed_alpha_us = 400;
  scaled.oversubscribed_behind_alpha_us = 3000;
  scaled.zero3_scale = 1.2;
  scaled.ranks_scale = 1.15;
  CHECK(scaled.at(2, 4).block_fwd == Approx(1.25 * 2e-3));
  CHECK(scaled.at(2, 3).block_bwd == Approx(1.25 * flat.calibration.at(2, 3).block_bwd));
  plan::save_local_cluster(dir + "/scaled.json", scaled, 8, 64.0 * (1 << 30));
  const plan::Cluster sb = plan::load_cluster("local:" + dir + "/scaled.json", clusters());
  CHECK(sb.calibration.step_scale == Approx(1.25));
  CHECK(sb.calibration.busy_scale == Approx(1.1));
  CHECK(sb.calibration.oversubscribed_alpha_us == Approx(400));
  CHECK(sb.calibration.oversubscribed_behind_alpha_us == Approx(3000));
  CHECK(sb.calibration.zero3_scale == Approx(1.2));
  CHECK(sb.calibration.ranks_scale == Approx(1.15));
  CHECK(sb.calibration.at(2, 4).block_fwd == Approx(1.25 * 2e-3));
  {
    std::ifstream in(dir + "/scaled.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string field = "\"step_scale\": 1.25";
    REQUIRE(text.find(field) != std::string::npos);
    std::ofstream(dir + "/zero.json") << text.replace(text.find(field), field.size(), "\"step_scale\": 0");
    CHECK_THROWS_WITH(plan::load_cluster("local:" + dir + "/zero.json", clusters()), Contains("step_scale"));
  }
  // Ranks beyond the cores: the oversubscribed latency is charged to a step only then.
  {
    plan::Cluster c = flat_local(1, 2);
    c.calibration.oversubscribed_alpha_us = 5000;
    plan::Job job = tiny_job(8);
    plan::Layout two, four;
    two.tp = 2;  // (tensor-parallel sums sit inside every block: always on the step's path)
    four.tp = 2;
    four.dp = 2;
    plan::Cluster none = c;
    none.calibration.oversubscribed_alpha_us = 0;
    CHECK(plan::predict(job, two, c).step_s == plan::predict(job, two, none).step_s);
    CHECK(plan::predict(job, four, c).step_s > plan::predict(job, four, none).step_s);
    // The latency behind the compute goes to the collectives that run there (the gradients'
    // buckets but the last, which the ranks wait for; ZeRO-3's gathers), not to the
    // tensor-parallel sums the compute waits for; and only where ranks outnumber cores.
    plan::Cluster behind = none;
    behind.calibration.oversubscribed_behind_alpha_us = 5000;
    plan::Layout dp4, dp2, one_bucket;
    dp4.dp = 4;
    dp4.bucket_mb = 0.1;  // about 16 buckets of the tiny model's gradients
    one_bucket.dp = 4;
    dp2.dp = 2;
    dp2.bucket_mb = 0.1;
    CHECK(plan::predict(job, dp2, behind).step_s == plan::predict(job, dp2, none).step_s);
    CHECK(plan::predict(job, dp4, behind).breakdown.dp_exposed >
          plan::predict(job, dp4, none).breakdown.dp_exposed);
    CHECK(plan::predict(job, one_bucket, behind).step_s == plan::predict(job, one_bucket, none).step_s);
    plan::Layout tp4;
    tp4.tp = 4;
    CHECK(plan::predict(job, tp4, behind).step_s == plan::predict(job, tp4, none).step_s);
    // A pipeline's sends travel while both stages compute.
    plan::Layout pp;
    pp.pp = 2;
    pp.tp = 2;
    pp.micro_batches = 4;
    CHECK(plan::predict(job, pp, behind).step_s > plan::predict(job, pp, none).step_s);
    // A figure behind the work below the one for callers is never charged: the larger counts.
    plan::Cluster low = c, same = c;
    low.calibration.oversubscribed_behind_alpha_us = 1;
    same.calibration.oversubscribed_behind_alpha_us = c.calibration.oversubscribed_alpha_us;
    CHECK(plan::predict(job, dp4, low).step_s == plan::predict(job, dp4, same).step_s);
    CHECK(plan::predict(job, dp4, low).step_s > plan::predict(job, dp4, none).step_s);
  }
  // ZeRO-3 beside the compute: its scale multiplies a ZeRO-3 rank's compute, and no other layout's.
  {
    plan::Cluster c = flat_local(1, 8), slow = c;
    slow.calibration.zero3_scale = 1.5;
    plan::Job job = tiny_job(8);
    plan::Layout dp, z1, z3;
    dp.dp = z1.dp = z3.dp = 2;
    z1.zero = 1;
    z3.zero = 3;
    CHECK(plan::predict(job, dp, slow).step_s == plan::predict(job, dp, c).step_s);
    CHECK(plan::predict(job, z1, slow).step_s == plan::predict(job, z1, c).step_s);
    CHECK(plan::predict(job, z3, slow).breakdown.compute ==
          Approx(1.5 * plan::predict(job, z3, c).breakdown.compute));
    // A rank's base holds a pair of shared-memory rings per same-host peer: the 2-rank base one
    // pair, each further peer one more (at the default ring size, 1 MiB each).
    {
      plan::Cluster m = c;
      m.calibration.base_rss_bytes = 100e6;
      plan::Layout four;
      four.dp = 4;
      CHECK(plan::predict(job, dp, m).memory.base == Approx(100e6));
      CHECK(plan::predict(job, four, m).memory.base == Approx(100e6 + 2 * 2 * ((1 << 20) + 3 * 64)));
    }
    // Ranks of one job: their scale multiplies every layout's compute but one process's.
    plan::Cluster ranks = c;
    ranks.calibration.ranks_scale = 1.25;
    plan::Layout one, tp;
    tp.tp = 2;
    CHECK(plan::predict(job, one, ranks).step_s == plan::predict(job, one, c).step_s);
    // (Not where each rank has a host of its own, whatever its threads.)
    plan::Cluster apart = flat_local(2, 8), apart_scaled = apart;
    apart_scaled.calibration.ranks_scale = 1.25;
    plan::Job threads = job;
    threads.threads = 2;
    CHECK(plan::predict(threads, dp, apart_scaled).step_s == plan::predict(threads, dp, apart).step_s);
    for (const plan::Layout& l : {dp, z3, tp})
      CHECK(plan::predict(job, l, ranks).breakdown.compute ==
            Approx(1.25 * plan::predict(job, l, c).breakdown.compute));
  }
  std::ofstream(dir + "/bad.json") << "{\"format\": \"trn-local-cluster\", \"cpu_cores\": -1}";
  CHECK_THROWS_WITH(plan::load_cluster("local:" + dir + "/bad.json", clusters()), Contains("\"cpu_cores\""));
  // The fp8 wire's format: the Trainium files say neuron; a file without it is ocp; a bad one is
  // named.
  CHECK(trn2.fp8_format == Fp8Format::kNeuron);
  CHECK(back.fp8_format == Fp8Format::kOCP);
  {
    std::ifstream in(clusters() + "/trn2.48xlarge.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string field = "\"fp8_format\": \"neuron\"";
    REQUIRE(text.find(field) != std::string::npos);
    std::ofstream(dir + "/odd.json") << text.replace(text.find(field), field.size(),
                                                     "\"fp8_format\": \"e4m3fnuz\"");
    CHECK_THROWS_WITH(plan::load_cluster("odd:1", dir),
                      Contains("\"device.fp8_format\" must be \"ocp\" or \"neuron\""));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a 16,384-rank trn2 plan ranks the layouts that fit first, fastest first") {
  const plan::Cluster cl = plan::load_cluster("trn2.48xlarge:1024", clusters());
  plan::Job job;
  job.model = model::preset("llama-3.1-70b");
  job.model.precision = model::Precision::kBf16;
  job.global_batch = 2048;
  job.seq_len = 8192;
  plan::Search s;
  s.max_cp = 2;  // cp 1 and 2 (4 and 8 would only lengthen the test)
  const std::vector<plan::Prediction> ps = plan::plan(job, cl, s);
  REQUIRE_FALSE(ps.empty());
  // 70B's weights, gradients and AdamW state (16 bytes a parameter) do not fit 96 GiB on few
  // model-parallel ranks without ZeRO: some layouts must not fit, and they come last.
  size_t fit = 0;
  while (fit < ps.size() && ps[fit].fits) ++fit;
  CHECK(fit > 0);
  CHECK(fit < ps.size());
  for (size_t i = fit; i < ps.size(); ++i) {
    CHECK_FALSE(ps[i].fits);
    CHECK(ps[i].memory.total() > cl.device_memory_bytes);
  }
  for (size_t i = 0; i < fit; ++i) {
    CHECK(ps[i].layout.world() == 16384);
    CHECK(ps[i].memory.total() <= cl.device_memory_bytes);
    if (i) CHECK(ps[i].step_s >= ps[i - 1].step_s);
  }
}

TEST_CASE("a stage's activation bytes are affine in its slots, as the planner counts them") {
  // The planner counts a stage's activations at 1 and 2 slots and extends them to any slot count.
  for (const char* name : {"tiny", "llama-tiny"}) {
    INFO(name);
    const model::Config c = model::preset(name);
    model::Placement p{1, 0, pipeline::chunks_of(c, {2, 4, 1}, 1)};
    const model::ParamLayout lay(c, p);
    const size_t one = model::Stage<float>::activation_bytes(lay, 2, 32, 1, 0);
    const size_t two = model::Stage<float>::activation_bytes(lay, 2, 32, 2, 0);
    for (int slots = 1; slots <= 6; ++slots)
      CHECK(model::Stage<float>::activation_bytes(lay, 2, 32, slots, 0) == one + size_t(slots - 1) * (two - one));
  }
}

namespace {

// A 70B-wide llama of n_layer blocks on 4 trn2 nodes (64 ranks).
plan::Job deep_job(int n_layer) {
  plan::Job job;
  job.model = model::preset("llama-3.1-70b");
  job.model.n_layer = n_layer;
  job.model.precision = model::Precision::kBf16;
  job.global_batch = 64;
  job.seq_len = 4096;
  return job;
}

}  // namespace

TEST_CASE("a search counts each stage shape once and simulates only the layouts that fit") {
  const plan::Cluster cl = plan::load_cluster("trn2.48xlarge:4", clusters());
  // 16 and 1296 = 16 x 81 layers have the same divisors among the 64 ranks' pipeline depths: the
  // search evaluates the same layouts and the same number of stage shapes, whatever the depth
  // (1296 layers fit nowhere, even recomputed).
  plan::SearchStats shallow, deep;
  plan::Search s;
  s.max_cp = 1;  // (context parallelism would only lengthen the test)
  s.stats = &shallow;
  const std::vector<plan::Prediction> a = plan::plan(deep_job(16), cl, s);
  s.stats = &deep;
  const std::vector<plan::Prediction> b = plan::plan(deep_job(1296), cl, s);
  CHECK(shallow.layouts == a.size());
  // The same candidates; the hybrid shard groups the search adds are those that fit.
  const auto whole = [](const std::vector<plan::Prediction>& ps) {
    return std::count_if(ps.begin(), ps.end(),
                         [](const plan::Prediction& p) { return p.layout.shard_group == 0; });
  };
  CHECK(whole(b) == whole(a));
  CHECK(deep.layouts == size_t(whole(b)));
  CHECK(deep.stage_shapes == shallow.stage_shapes);
  CHECK(shallow.stage_shapes < shallow.layouts);
  for (const auto& [ps, st] : {std::pair{&a, &shallow}, std::pair{&b, &deep}}) {
    const size_t fit = size_t(std::count_if(ps->begin(), ps->end(), [](const plan::Prediction& p) { return p.fits; }));
    CHECK(st->simulated == fit);
    for (const plan::Prediction& p : *ps) CHECK(p.timed == p.fits);
  }
  // The deep model fits nowhere: its layouts are ranked by the memory they need, least first.
  REQUIRE_FALSE(b.empty());
  CHECK(deep.simulated == 0);
  for (size_t i = 1; i < b.size(); ++i) CHECK(b[i].memory.total() >= b[i - 1].memory.total());
}

TEST_CASE("the search's predictions are predict's") {
  // Memory counted once per stage shape and simulation only of what fits give each layout the
  // prediction predict gives it alone.
  // (The mixture of experts searches ep 1, 2 and 4: the cache must tell the stages' experts apart.)
  for (const auto& [cluster, job] : {std::pair{"trn2.48xlarge:4", deep_job(16)}, std::pair{"trn1.32xlarge:1", tiny_job(8)},
                                     std::pair{"trn1.32xlarge:1", deep_job(4)}, std::pair{"local", tiny_job(8)},
                                     std::pair{"local", moe_job(8)}}) {
    INFO(cluster << " " << job.model.n_layer << " layers");
    const plan::Cluster cl =
        std::string(cluster) == "local" ? flat_local(1, 4) : plan::load_cluster(cluster, clusters());
    // Context parallelism on the 4-layer job alone (cp 1 and 2; the activations' cache must tell a
    // cp rank's tokens from a sequence's), to keep the test short.
    plan::Search s;
    s.max_cp = job.model.n_layer == 4 ? 2 : 1;
    const std::vector<plan::Prediction> ps = plan::plan(job, cl, s);
    for (const plan::Prediction& p : ps) {
      INFO(p.layout.flags());
      const plan::Prediction one = plan::predict(job, p.layout, cl);
      CHECK(one.fits == p.fits);
      CHECK(one.memory.total() == p.memory.total());
      CHECK(one.memory.activations == p.memory.activations);
      if (p.fits) {
        CHECK(one.step_s == p.step_s);
        CHECK(one.breakdown.bubble == p.breakdown.bubble);
      }
    }
  }
}

TEST_CASE("a cluster no layout can use is one usage error naming the constraint") {
  // tiny: 2 layers, 4 heads; a global batch of 8 reaches at most 8 x 4 x 2 = 64 of 128 ranks.
  const plan::Cluster cl = plan::load_cluster("trn2.48xlarge:8", clusters());
  plan::Job job = tiny_job(8);
  job.seq_len = 128;
  try {
    plan::plan(job, cl);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Contains("no layout uses all 128 ranks"));
    CHECK_THAT(e.what(), Contains("the largest such grid has 64 ranks"));
  }
}

TEST_CASE("a search asked to stop ends with an aborted error") {
  const plan::Cluster cl = plan::load_cluster("trn2.48xlarge:4", clusters());
  plan::Search s;
  int asked = 0;
  s.stop = [&] { return ++asked > 3; };
  try {
    plan::plan(deep_job(16), cl, s);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kAborted);
    CHECK_THAT(e.what(), Contains("the search stopped"));
  }
}

TEST_CASE("ZeRO 2 and 3 are searched, counted by parallel::memory and charged their gathers") {
  // GPT-2 124M over 4 data-parallel ranks of one host.
  const plan::Cluster cl = flat_local(1, 8);
  plan::Job job = tiny_job(8);
  job.model = model::preset("gpt2");
  // ZeRO-3 without prefetch: it holds one gather unit at a time. GPT-2's largest unit is the head
  // with the tied wte (31% of the model) rounded out by a 25 MiB bucket at each end, so with one
  // unit prefetched (two held) it holds more than ZeRO-1 at dp 4 (the 3/4 of the master it
  // shards is less than the second unit plus its gradients' shard).
  auto at = [&](int zero) {
    plan::Layout l;
    l.dp = 4;
    l.zero = zero;
    l.prefetch = zero == 3 ? 0 : 1;
    return plan::predict(job, l, cl);
  };
  const plan::Prediction z0 = at(0), z1 = at(1), z2 = at(2), z3 = at(3);
  for (const plan::Prediction* p : {&z0, &z1, &z2, &z3}) {
    REQUIRE(p->runs);
    parallel::MemoryInputs in;
    in.bf16_copy_half = false;  // fp32: no copy either way
    CHECK(p->memory.weights == parallel::memory(p->layout, job.model, job.global_batch, job.seq_len, in).weights);
  }
  // ZeRO-1 shards AdamW's moments; ZeRO-3 the fp32 master too (the gather units it holds instead
  // are a few blocks).
  CHECK(z3.memory.total() < z1.memory.total());
  CHECK(z1.memory.total() < z0.memory.total());
  const model::ParamLayout lay(job.model);
  CHECK(z3.memory.weights == Approx(4.0 * lay.total() / 4));

  // ZeRO-1's sync is a reduce-scatter and the updated weights' all-gather; ZeRO-3 has no gather
  // after the update but gathers the weights for each micro-batch's forward and backward.
  CHECK(z1.breakdown.dp_bytes == Approx(2 * 0.75 * 4.0 * lay.total()));
  CHECK(z3.breakdown.dp_bytes > z1.breakdown.dp_bytes);
  // The reduce-scatter, then the blocks gathered twice a micro-batch, the embedding and the head
  // (with the tied wte) once each: at most three times the buffer.
  CHECK(z3.breakdown.dp_bytes > 2.5 * 0.75 * 4.0 * lay.total());
  CHECK(z3.breakdown.dp_bytes <= 3 * 0.75 * 4.0 * lay.total());
  CHECK(z2.breakdown.dp_bytes == z1.breakdown.dp_bytes);
  // More micro-batches gather more.
  plan::Layout m2;
  m2.dp = 4;
  m2.zero = 3;
  m2.micro_batches = 2;
  CHECK(plan::predict(job, m2, cl).breakdown.dp_bytes > z3.breakdown.dp_bytes);

  // The search offers every stage where there is something to shard, and ZeRO 0 alone at dp 1.
  plan::Job small = tiny_job(8);
  const std::vector<plan::Prediction> ps = plan::plan(small, flat_local(1, 2));
  std::set<int> stages, at_dp1;
  for (const plan::Prediction& p : ps) (p.layout.dp > 1 ? stages : at_dp1).insert(p.layout.zero);
  CHECK(stages == std::set<int>{0, 1, 2, 3});
  CHECK(at_dp1 == std::set<int>{0});
  CHECK(std::any_of(ps.begin(), ps.end(), [](const plan::Prediction& p) {
    return p.layout.zero == 3 && p.layout.flags().find("--zero 3") != std::string::npos;
  }));
}

TEST_CASE("ZeRO-3's gathers hide behind compute but the first unit's, unless they outlast it") {
  plan::StepInput in;
  in.n_layer = 2;
  in.M = 2;
  in.cost.block_fwd = 1;
  in.cost.block_bwd = 2;
  in.cost.embedding_fwd = 0.5;
  in.cost.head_fwd = 1;
  in.cost.head_bwd = 2;
  const double whole = plan::simulate_step(in).step_s;
  auto with_gathers = [&](double secs, int prefetch) {
    plan::StepInput g = in;
    g.prefetch = prefetch;
    g.gathers = {{secs, 0.5, 0}, {secs, 1, 0}, {secs, 1, 0}, {secs, 1, 2}, {secs, 0, 2}, {secs, 0, 2}};
    return plan::simulate_step(g);
  };
  // Short gathers, one ahead: each pass waits for its first unit alone.
  const plan::StepResult fast = with_gathers(0.1, 1);
  CHECK(fast.gather_wait_s == Approx(2 * 0.1));
  CHECK(fast.step_s == Approx(whole + 2 * 0.1));
  CHECK(fast.bubble_s == Approx(0.0));
  // Without prefetch every gather waits for the compute before it to ask.
  CHECK(with_gathers(0.1, 0).gather_wait_s == Approx(2 * 6 * 0.1));
  // Gathers longer than the compute they overlap set the pace: 6 of 3 s per pass.
  CHECK(with_gathers(3, 1).step_s == Approx(2 * (6 * 3 + 2)));
}

TEST_CASE("context parallelism's exchange is the hand count, on the links the grid puts the cp ranks on") {
  // llama-tiny: 4 heads, 2 KV heads of 32; 2 sequences of 64 tokens per micro-batch.
  const model::Config c = model::preset("llama-tiny");
  REQUIRE(c.n_head == 4);
  REQUIRE(c.kv_heads() == 2);
  REQUIRE(c.head_dim() == 32);
  const int B = 2, T = 64;
  plan::Layout l;
  l.cp = 2;
  // Ring, cp 2: each rank holds 2 x 32 tokens; a block is their keys and values, 2 x 2 x 32
  // floats a token: 4 x 128 x 64 = 32,768 bytes. Forward sends it once, backward once more and
  // two gradient blocks.
  plan::CpTraffic t = plan::cp_traffic(c, l, B, T);
  CHECK(t.block == 32768);
  CHECK(t.fwd_bytes == 32768);
  CHECK(t.bwd_bytes == 3 * 32768);
  l.cp = 4;  // 2 x 16 tokens a rank: half the block, sent 3 times forward, 3 + 4 backward
  t = plan::cp_traffic(c, l, B, T);
  CHECK(t.block == 16384);
  CHECK(t.fwd_bytes == 3 * 16384);
  CHECK(t.bwd_bytes == 7 * 16384);
  // All-to-all, cp 2: q, k, v are (4 + 2 x 2) x 32 floats a token over 64 tokens (65,536 bytes),
  // the output 4 x 32 (32,768); each all-to-all sends half of its tensor away.
  l.cp = 2;
  l.cp_comm = cp::Comm::kAllToAll;
  t = plan::cp_traffic(c, l, B, T);
  CHECK(t.a2a_fwd == std::vector<double>{65536, 32768});
  CHECK(t.a2a_bwd == std::vector<double>{65536, 65536, 65536});
  CHECK(t.fwd_bytes == (65536 + 32768) / 2);
  CHECK(t.bwd_bytes == 3 * 65536 / 2);
  l.cp = 1;
  CHECK(plan::cp_traffic(c, l, B, T).fwd_bytes == 0);

  // One host: the ring's blocks over the intra-node link. Without attention to hide behind, every
  // transfer is charged: forward cp - 1 steps, backward cp - 1 steps of a block and a gradient
  // and the last gradient; with much attention only that last one.
  const plan::Cluster local = flat_local(1, 8);
  l = plan::Layout{};
  l.cp = 4;
  t = plan::cp_traffic(c, l, B, T);
  const CostParams& in = local.links.intra;
  const double msg = (in.alpha_us + t.block / 1024 * in.beta_us_per_kib) * 1e-6;
  plan::CpCost cost = plan::cp_cost(local, c, l, B, T, 0);
  CHECK(cost.fwd_s == Approx(3 * msg));
  CHECK(cost.bwd_s == Approx(3 * 2 * msg + msg));
  CHECK(cost.link_bwd_s == Approx(7 * msg));
  cost = plan::cp_cost(local, c, l, B, T, 1.0);
  CHECK(cost.fwd_s == 0);
  CHECK(cost.bwd_s == Approx(msg));
  CHECK(cost.link_fwd_s == Approx(3 * msg));

  // trn2 (16 ranks a node): cp ranks are tp apart, so tp 4 x cp 4 is one node's NeuronLink and
  // tp 8 x cp 4 spans two nodes, the ring crossing between them on EFA, where the node's 8 cp
  // groups (2 of each group's ranks on each node) share the rails.
  model::Config big = model::preset("llama-3.1-70b");
  const int T2 = 32768;
  l = plan::Layout{};
  l.tp = 4;
  l.cp = 4;
  const plan::Cluster one = plan::load_cluster("trn2.48xlarge:1", clusters());
  t = plan::cp_traffic(big, l, 1, T2);
  CHECK(plan::cp_cost(one, big, l, 1, T2, 0).fwd_s ==
        Approx(3 * (one.links.intra.alpha_us + t.block / 1024 * one.links.intra.beta_us_per_kib) * 1e-6));
  l.tp = 8;
  const plan::Cluster two = plan::load_cluster("trn2.48xlarge:2", clusters());
  t = plan::cp_traffic(big, l, 1, T2);
  CHECK(plan::cp_cost(two, big, l, 1, T2, 0).fwd_s ==
        Approx(3 * (two.links.inter.alpha_us + t.block / 1024 * two.links.inter.beta_us_per_kib * 8) * 1e-6));
}

TEST_CASE("memory per rank falls with cp, and the step charges the exchange over dp x cp replicas") {
  // Llama-3.1-70B, bf16, one 32,768-token sequence per data-parallel rank, tp 8, ZeRO-3.
  plan::Job job;
  job.model = model::preset("llama-3.1-70b");
  job.model.precision = model::Precision::kBf16;
  job.global_batch = 16;
  job.seq_len = 32768;
  double last = 0, last_act = 0;
  for (int cp : {1, 2, 4, 8}) {
    INFO("cp " << cp);
    plan::Layout l;
    l.dp = 16;
    l.tp = 8;
    l.cp = cp;
    l.zero = 3;
    const plan::Cluster cl = plan::load_cluster("trn2.48xlarge:" + std::to_string(8 * cp), clusters());
    const plan::Prediction p = plan::predict(job, l, cl);
    REQUIRE(p.runs);
    if (cp > 1) {
      CHECK(p.memory.total() < last);
      CHECK(p.memory.activations < last_act);
      CHECK(p.breakdown.cp_comm > 0);
    } else {
      CHECK(p.breakdown.cp_comm == 0);
    }
    // ZeRO-3 shards the weights over the dp x cp replicas.
    const model::ParamLayout lay(job.model, l.placement(job.model, 0, 0));
    CHECK(p.memory.weights == Approx(4.0 * double(lay.total()) / (16 * cp)));
    last = p.memory.total();
    last_act = p.memory.activations;
  }
}

TEST_CASE("the search takes cp > 1 only where it is better, and never a cp layout check() refuses") {
  // (Where it is needed, Llama-3.1-70B at 32,768 tokens: tests/integration/plan.)
  // llama-tiny on 1 or 2 ranks of one host, 2,048-token sequences: cp only adds its exchange to the same
  // per-rank work, so the best layout has cp 1, though cp 2 and 4 are searched.
  plan::Job small = tiny_job(8);
  small.model = model::preset("llama-tiny");
  small.model.ctx = 2048;
  small.seq_len = 2048;
  const std::vector<plan::Prediction> ps = plan::plan(small, flat_local(1, 2));
  REQUIRE(ps.front().fits);
  CHECK(ps.front().layout.cp == 1);
  std::set<std::tuple<int, int, cp::Comm>> seen;  // tp, cp, exchange
  for (const plan::Prediction& p : ps) {
    INFO(p.layout.flags());
    seen.insert({p.layout.tp, p.layout.cp, p.layout.cp_comm});
    REQUIRE(p.runs);
    CHECK_NOTHROW(parallel::check(p.layout, small.model, small.global_batch, "--dp", small.seq_len));
    // Context parallelism only at one sequence per micro-batch (halving cp, doubling dp is better).
    if (p.layout.cp > 1) CHECK(p.layout.micro_batch(small.global_batch) == 1);
  }
  // llama-tiny's 2 KV heads take the all-to-all at tp 1 x cp 2, not at tp 2 x cp 2 (check refuses
  // it); the ring at both. cp stops at 2: 1,024 tokens a rank at least.
  CHECK(seen.count({1, 2, cp::Comm::kAllToAll}) == 1);
  CHECK(seen.count({1, 2, cp::Comm::kRing}) == 1);
  CHECK(seen.count({2, 2, cp::Comm::kAllToAll}) == 0);
  for (const auto& [tp, cp, comm] : seen) CHECK(cp <= 2);
  plan::Layout refused;
  refused.cp = 4;
  refused.cp_comm = cp::Comm::kAllToAll;
  const plan::Prediction r = plan::predict(small, refused, flat_local(1, 4));
  CHECK_FALSE(r.runs);
  CHECK_THAT(r.why_not, Contains("--cp-comm all-to-all"));
  refused.cp_comm = cp::Comm::kRing;
  small.seq_len = 2044;  // not a multiple of 2 x 4
  CHECK_THAT(plan::predict(small, refused, flat_local(1, 4)).why_not, Contains("multiple of 8"));

}

TEST_CASE("expert parallelism's all-to-alls are the hand count, on the links the grid puts the ep ranks on") {
  // A token goes once to each ep rank holding any of its k choices: 1 row at ep 1, k at ep = E,
  // and in between ep (1 - C(E - E/ep, k) / C(E, k)) on routing uniform over the experts.
  CHECK(plan::ep_rows_per_token(4, 2, 1) == 1);
  CHECK(plan::ep_rows_per_token(4, 2, 4) == Approx(2));
  CHECK(plan::ep_rows_per_token(4, 2, 2) == Approx(2 * (1 - 2.0 * 1 / (4 * 3))));  // 5/3
  CHECK(plan::ep_rows_per_token(8, 2, 2) == Approx(2 * (1 - 4.0 * 3 / (8 * 7))));   // 11/7
  CHECK(plan::ep_rows_per_token(128, 8, 64) <= 8);
  CHECK(plan::ep_rows_per_token(128, 8, 64) > 7.5);

  // mixtral-tiny (C 64, k 2) at ep 4 = E, 2 sequences of 32 tokens: 128 rows. Forward sends rows
  // of C + 2k (68 floats) and gets back rows of C; backward sends C and gets back C + k (66);
  // 3/4 of each buffer leaves the rank.
  const model::Config c = model::preset("mixtral-tiny");
  REQUIRE(c.n_experts == 4);
  REQUIRE(c.top_k == 2);
  REQUIRE(c.d_model == 64);
  plan::Layout l;
  l.dp = 4;
  l.ep = 4;
  plan::EpTraffic t = plan::ep_traffic(c, l, 2, 32);
  CHECK(t.a2a_fwd == std::vector<double>{4 * 128 * 68, 4 * 128 * 64});
  CHECK(t.a2a_bwd == std::vector<double>{4 * 128 * 64, 4 * 128 * 66});
  CHECK(t.fwd_bytes == Approx(0.75 * 4 * 128 * (68 + 64)));
  CHECK(t.bwd_bytes == Approx(0.75 * 4 * 128 * (64 + 66)));
  l.ep = 1;
  CHECK(plan::ep_traffic(c, l, 2, 32).fwd_bytes == 0);
  l.ep = 4;
  CHECK(plan::ep_traffic(model::preset("llama-tiny"), l, 2, 32).fwd_bytes == 0);  // no experts

  // One host: every message over the intra-node link, the four all-to-alls waited for.
  const plan::Cluster local = flat_local(1, 8);
  const CostParams& in = local.links.intra;
  auto a2a = [&](double bytes) { return (in.alpha_us + 3 * (bytes / 4 / 1024) * in.beta_us_per_kib) * 1e-6; };
  const plan::EpCost cost = plan::ep_cost(local, c, l, 2, 32);
  CHECK(cost.fwd_s == Approx(a2a(t.a2a_fwd[0]) + a2a(t.a2a_fwd[1])));
  CHECK(cost.bwd_s == Approx(a2a(t.a2a_bwd[0]) + a2a(t.a2a_bwd[1])));

  // trn2 (16 ranks a node): the ep ranks are consecutive replicas, tp apart. At tp 4 x ep 4 they
  // are one node's; at tp 8 x ep 4 two nodes', 2 on each, whose crossing messages share the
  // node's rails with its 16 ranks' all-to-alls.
  model::Config big = model::preset("mixtral-8x7b");
  const int T = 4096;
  l = plan::Layout{};
  l.dp = 4;
  l.ep = 4;
  l.tp = 4;
  const plan::Cluster one = plan::load_cluster("trn2.48xlarge:1", clusters());
  t = plan::ep_traffic(big, l, 1, T);
  const CostParams& nl = one.links.intra;
  CHECK(plan::ep_cost(one, big, l, 1, T).fwd_s ==
        Approx((2 * nl.alpha_us + 3 * (t.a2a_fwd[0] + t.a2a_fwd[1]) / 4 / 1024 * nl.beta_us_per_kib) * 1e-6));
  l.tp = 8;
  const plan::Cluster two = plan::load_cluster("trn2.48xlarge:2", clusters());
  REQUIRE(two.links.inter.link_shared > 0);
  const CostParams &ni = two.links.intra, &ne = two.links.inter;
  auto crossing = [&](double bytes) {
    const double piece = bytes / 4 / 1024;
    return std::max(ni.alpha_us + piece * ni.beta_us_per_kib,
                    ne.alpha_us + 2 * piece * ne.beta_us_per_kib * 16) * 1e-6;
  };
  CHECK(plan::ep_cost(two, big, l, 1, T).bwd_s == Approx(crossing(t.a2a_bwd[0]) + crossing(t.a2a_bwd[1])));
  plan::Layout inside = l;
  inside.tp = 4;
  CHECK(plan::ep_cost(two, big, l, 1, T).fwd_s > plan::ep_cost(one, big, inside, 1, T).fwd_s);
}

TEST_CASE("an MoE block computes its active parameters; ep divides its experts' memory and their sync") {
  // mixtral-tiny on 4 ranks of a trn1 node (devices: compute from FLOPs), 4 sequences of 64 tokens.
  const plan::Cluster cl = plan::load_cluster("trn1.32xlarge:1", clusters());
  plan::Job job = moe_job(16);
  auto at = [&](const plan::Job& j, int ep) { return predict_ep(j, cl, 16, ep); };
  const plan::Prediction e1 = at(job, 1), e2 = at(job, 2), e4 = at(job, 4);
  // A token runs the router and 2 of the experts: twice the experts (8) leave the compute as it
  // was but for the router's 4 more rows.
  plan::Job wide = job;
  wide.model.n_experts = 8;
  CHECK(at(wide, 1).breakdown.compute == Approx(e1.breakdown.compute).epsilon(0.01));
  CHECK(at(wide, 1).memory.weights > 1.5 * e1.memory.weights);
  // Balanced, an ep rank computes as much as with the experts whole, and waits for its all-to-alls.
  for (const plan::Prediction* p : {&e2, &e4}) {
    INFO(p->layout.flags());
    CHECK_THAT(p->layout.flags(), Contains("--ep "));
    CHECK(p->breakdown.compute == Approx(e1.breakdown.compute));
    CHECK(p->breakdown.ep_comm > 0);
  }
  CHECK(e1.breakdown.ep_comm == 0);
  // Memory: the rank's n_experts / ep experts of each layer (parallel::memory's count).
  const model::ParamLayout whole(job.model);
  double experts = 0;
  for (const model::TensorSpec& t : whole.tensors())
    if (parallel::is_expert(t.name)) experts += double(t.numel);
  REQUIRE(experts > 0.5 * double(whole.total()));
  CHECK(e1.memory.weights == 4.0 * double(whole.total()));
  CHECK(e2.memory.weights == 4.0 * (double(whole.total()) - experts / 2));
  CHECK(e4.memory.weights == 4.0 * (double(whole.total()) - 3 * experts / 4));
  CHECK(e4.memory.optimizer == 2 * e4.memory.weights);
  CHECK(e4.memory.total() < e2.memory.total());
  CHECK(e2.memory.total() < e1.memory.total());
  // The experts' gradients are summed over the 16 / ep replicas holding them, the rest over all 16.
  const double dense = double(whole.total()) - experts;
  CHECK(e1.breakdown.dp_bytes == Approx(2 * 15.0 / 16 * 4 * double(whole.total())));
  CHECK(e4.breakdown.dp_bytes == Approx(2 * 4.0 * (15.0 / 16 * dense + 3.0 / 4 * experts / 4)));
}

TEST_CASE(
    "measured routing: ep's busiest rank is waited for and its rows held, read from trn-train's metrics") {
  // Two steps of 2 layers of 4 experts (mixtral-tiny): ranks hold experts {0,1} and {2,3} at ep 2.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("trn-plan-moe-loads-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "metrics.jsonl").string();
  {
    std::ofstream f(path);
    f << R"({"step": 1, "loss": 5, "moe_loads": [[30, 10, 10, 10], [10, 10, 10, 10]]})"
         "\n"
      << R"({"step": 2, "loss": 5, "val_loss": 4})"
         "\n"
      << R"({"step": 2, "loss": 5, "moe_loads": [[10, 10, 10, 10], [20, 20, 0, 0]]})"
         "\n";
  }
  const plan::MoeLoads m = plan::MoeLoads::read(path, 2, 4);
  REQUIRE(m.steps.size() == 2);
  // Step 1: layer 0's ranks take 40 and 20 (busiest 40 / 30), layer 1 balanced; step 2: layer 0
  // balanced, layer 1 all on rank 0 (2). Time: the mean over steps and layers; peak: per layer
  // the largest, then the mean.
  CHECK(m.busiest(2, false) == Approx((4.0 / 3 + 1 + 1 + 2) / 4));
  CHECK(m.busiest(2, true) == Approx((4.0 / 3 + 2) / 2));
  CHECK(m.busiest(1, true) == 1.0);
  CHECK(m.busiest(4, false) == Approx((30.0 / 15 + 1 + 1 + 2) / 4));
  // Another model's loads, a file without them: one line naming the file.
  CHECK_THROWS_WITH(plan::MoeLoads::read(path, 2, 8), Contains("are not 2 layers of 8 experts"));
  {
    std::ofstream f(path);
    f << R"({"step": 1, "loss": 5})"
         "\n";
  }
  CHECK_THROWS_WITH(plan::MoeLoads::read(path, 2, 4), Contains("--metrics-moe-loads"));

  // The prediction: ep 2 waits for the busiest rank (more ep time, the same compute) and holds
  // its rows (more activations); ep 1 is as it was.
  const plan::Cluster cl = flat_local(1, 8);
  plan::Job job = moe_job(8);
  plan::Job skewed = job;
  skewed.moe_loads.steps = {
      {{40, 0, 0, 0}, {10, 10, 10, 10}}};  // layer 0: all on rank 0 (2), layer 1 balanced
  auto at = [&](const plan::Job& j, int ep) { return predict_ep(j, cl, 4, ep); };
  CHECK(at(skewed, 1).step_s == at(job, 1).step_s);
  CHECK(at(skewed, 1).memory.total() == at(job, 1).memory.total());
  const plan::Prediction b = at(job, 2), s = at(skewed, 2);
  CHECK(s.breakdown.ep_comm > b.breakdown.ep_comm);
  CHECK(s.step_s > b.step_s);
  CHECK(s.memory.activations > b.memory.activations);
  CHECK(s.memory.weights == b.memory.weights);
  std::filesystem::remove_all(dir);
}

TEST_CASE("the search takes ep for a mixture of experts: powers of two dividing the replicas and the experts") {
  const plan::Cluster cl = flat_local(1, 8);
  std::set<int> seen;
  for (const plan::Prediction& p : plan::plan(moe_job(8), cl)) {
    INFO(p.layout.flags());
    seen.insert(p.layout.ep);
    CHECK(p.layout.replicas() % p.layout.ep == 0);
    CHECK_NOTHROW(parallel::check(p.layout, model::preset("mixtral-tiny"), 8, "--dp", 64));
    if (p.layout.ep > 1) CHECK(p.layout.shard_group == 0);  // (ZeRO under ep shards over the experts' holders)
  }
  CHECK(seen == std::set<int>{1, 2, 4});  // 4 experts: no ep 8 though 8 replicas
  plan::Search s;
  s.max_ep = 2;
  seen.clear();
  for (const plan::Prediction& p : plan::plan(moe_job(8), cl, s)) seen.insert(p.layout.ep);
  CHECK(seen == std::set<int>{1, 2});
  s.max_ep = 1;
  seen.clear();
  for (const plan::Prediction& p : plan::plan(moe_job(8), cl, s)) seen.insert(p.layout.ep);
  CHECK(seen == std::set<int>{1});
  // A dense model: no expert parallelism.
  seen.clear();
  for (const plan::Prediction& p : plan::plan(tiny_job(8), flat_local(1, 4))) seen.insert(p.layout.ep);
  CHECK(seen == std::set<int>{1});
}

TEST_CASE("the search recomputes the fewest blocks that fit when only full recomputation fits") {
  // One rank (a trn2 device) and one sequence per step: the layouts differ only in recomputation.
  plan::Cluster cl = plan::load_cluster("trn2.48xlarge:1", clusters());
  cl.ranks_per_node = 1;
  plan::Job job = tiny_job(1);
  job.model.n_layer = 8;
  job.seq_len = 256;
  const auto with = [&](parallel::Recompute rc, int layers) {
    plan::Layout l;
    l.recompute = rc;
    l.recompute_layers = layers;
    return plan::predict(job, l, cl);
  };
  // Memory falls with every block recomputed, and the step grows.
  std::vector<plan::Prediction> full;
  for (int n = 1; n <= 8; ++n) full.push_back(with(parallel::Recompute::kFull, n));
  for (int n = 1; n < 8; ++n) {
    CHECK(full[n].memory.total() < full[n - 1].memory.total());
    CHECK(full[n].step_s > full[n - 1].step_s);
  }
  const plan::Prediction all = with(parallel::Recompute::kFull, 0),
                         none = with(parallel::Recompute::kNone, 0),
                         selective = with(parallel::Recompute::kSelective, 0);
  CHECK(all.memory.total() == full[7].memory.total());
  CHECK(all.step_s == full[7].step_s);
  // A device that holds n recomputed blocks' worth but not n - 1, less than selective needs: full
  // on n blocks per chunk wins, faster than full on all 8, and neither none nor selective fits.
  int n = 2;
  while (n < 8 && full[n - 2].memory.total() >= selective.memory.total()) ++n;
  REQUIRE(n < 8);
  cl.device_memory_bytes = (full[n - 1].memory.total() + full[n - 2].memory.total()) / 2;
  plan::SearchStats st;
  plan::Search s;
  s.stats = &st;
  const std::vector<plan::Prediction> ps = plan::plan(job, cl, s);
  REQUIRE(ps.front().fits);
  INFO(ps.front().layout.flags());
  CHECK(ps.front().layout.recompute == parallel::Recompute::kFull);
  CHECK(ps.front().layout.recompute_layers == n);
  CHECK_THAT(ps.front().layout.flags(), Contains("--recompute full --recompute-layers " + std::to_string(n)));
  CHECK(ps.front().step_s == full[n - 1].step_s);
  CHECK(ps.front().step_s < all.step_s);
  CHECK(st.probed > 0);
  for (const plan::Prediction& p : ps)
    if (p.layout.recompute != parallel::Recompute::kFull) CHECK_FALSE(p.fits);
  // With room for everything, recomputing is slower: none wins, and the full layouts kept are
  // on the fewest blocks, 1.
  cl.device_memory_bytes = 2 * none.memory.total();
  const std::vector<plan::Prediction> roomy = plan::plan(job, cl);
  CHECK(roomy.front().layout.recompute == parallel::Recompute::kNone);
  for (const plan::Prediction& p : roomy)
    if (p.layout.recompute == parallel::Recompute::kFull) CHECK(p.layout.recompute_layers == 1);
}

TEST_CASE("the search takes a hybrid shard group where the whole group's gathers cross a slow link") {
  // Two hosts of 4 ranks, 2 ms apart: ZeRO-3 over all 8 replicas waits for the far host in every
  // weight gather; sharded over each host's 4 (--shard-group 4) its gathers stay on the host and
  // only the gradients' shard crosses, once per bucket.
  plan::Cluster cl = flat_local(2, 8);
  cl.ranks_per_node = 4;
  cl.delay_s = 2e-3;
  const plan::Job job = tiny_job(8);
  plan::Layout whole;
  whole.dp = 8;
  whole.zero = 3;
  plan::Layout hybrid = whole;
  hybrid.shard_group = 4;
  const plan::Prediction w = plan::predict(job, whole, cl), h = plan::predict(job, hybrid, cl);
  INFO("whole " << w.step_s << " s, " << w.memory.total() << " B; hybrid " << h.step_s << " s, "
                << h.memory.total());
  CHECK(h.step_s < w.step_s);
  CHECK(h.memory.total() > w.memory.total());  // each host holds a whole copy of the sharded state
  CHECK(h.breakdown.dp_exposed < w.breakdown.dp_exposed);
  CHECK_THAT(h.layout.flags(), Contains("--zero 3 --shard-group 4"));
  plan::SearchStats st;
  plan::Search s;
  s.stats = &st;
  const std::vector<plan::Prediction> ps = plan::plan(job, cl, s);
  REQUIRE(ps.front().fits);
  INFO("best " << ps.front().layout.flags());
  // The search found the hybrid of the sharded layouts it kept and ranks it above them.
  const auto it = std::find_if(ps.begin(), ps.end(), [](const plan::Prediction& p) {
    return p.layout.dp == 8 && p.layout.zero == 3 && p.layout.shard_group == 4 &&
           p.layout.recompute == parallel::Recompute::kNone;
  });
  REQUIRE(it != ps.end());
  CHECK(it->step_s == h.step_s);
  const auto w_it = std::find_if(ps.begin(), ps.end(), [](const plan::Prediction& p) {
    return p.layout.dp == 8 && p.layout.zero == 3 && p.layout.shard_group == 0 &&
           p.layout.recompute == parallel::Recompute::kNone && p.layout.micro_batches == 1;
  });
  REQUIRE(w_it != ps.end());
  CHECK(it < w_it);
  CHECK(st.probed > 0);
}
