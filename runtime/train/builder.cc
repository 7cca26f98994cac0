#include "runtime/train/builder.h"

#include "runtime/context_parallel/attention.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"
#include "runtime/model/one_stage.h"
#include "runtime/optim/adamw.h"
#include "runtime/pipeline_parallel/pipeline.h"
#include "runtime/train/dp_sync.h"
#include "runtime/train/zero_adamw.h"
#include "runtime/train/zero_sync.h"

namespace trn::train {
namespace {

using log::Subsys;

// The data-parallel sync of a buffer of this layout: bucketed all-reduce, or ZeRO-1's
// reduce-scatter whose buckets end on the norm's pieces. *zero is set to the latter when it runs
// (the optimizer is built on it).
std::unique_ptr<GradientSync> build_sync(const Options& opt, const parallel::ProcessGrid& grid,
                                         const model::ParamLayout& layout,
                                         const std::shared_ptr<Communicator>& expert_replicas,
                                         const std::shared_ptr<Communicator>& ep, ZeroSync** zero) {
  const parallel::Plan& plan = opt.plan;
  DataParallelOptions dpo{
      .bucket_bytes = plan.bucket_bytes(), .wire = plan.grad_wire, .fp8_format = plan.fp8_format};
  *zero = nullptr;
  if (plan.ep > 1) {
    // The experts' gradients: averaged over the replicas holding the same experts (the ZeRO
    // shard group), then / ep (each expert rank summed the contributions of its expert group's
    // tokens).
    for (const model::TensorSpec& t : layout.tensors())
      if (t.expert) {
        if (!dpo.expert_ranges.empty() && dpo.expert_ranges.back().end == t.offset)
          dpo.expert_ranges.back().end = t.offset + t.numel;
        else
          dpo.expert_ranges.push_back({t.offset, t.offset + t.numel});
      }
    dpo.experts = expert_replicas;
    dpo.expert_scale = 1.0f / float(plan.ep);
  }
  if (!plan.sharded()) return std::make_unique<DataParallelSync>(grid.dp(), layout.total(), dpo);
  // The tied wte starts and ends a bucket, so the first and the last stage, whose buffers differ,
  // slice it alike and can sum its gradient slice by slice over the embedding group.
  std::vector<size_t> forced;
  if (const model::TensorSpec* wte = layout.tied(); wte && plan.pp > 1) forced = {wte->offset, wte->offset + wte->numel};
  for (const DataParallelOptions::Range& r : dpo.expert_ranges) {
    forced.push_back(r.begin);
    forced.push_back(r.end);
  }
  const parallel::Coords me = grid.coords();
  const int ep_rank = plan.ep_rank(grid.shape().replica(me));
  optim::NormPieces pieces = optim::norm_pieces(layout, plan.tp, plan.pp, me.tp, me.pp, plan.ep, ep_rank);
  // No bucket spans two gather units (a block, the head, the embedding) beyond the one norm
  // piece straddling their border (optim::unit_stops): ZeRO-3 gathers whole buckets, so a bucket
  // over a border would be gathered (and its memory held) for the units on both sides; a whole
  // block's when blocks are smaller than a bucket. Every stage cuts alike, so stages 1-3 stay
  // bit-identical to each other.
  const std::vector<size_t> stops = optim::unit_stops(layout, pieces.cuts());
  forced.insert(forced.end(), stops.begin(), stops.end());
  std::sort(forced.begin(), forced.end());
  forced.erase(std::unique(forced.begin(), forced.end()), forced.end());
  // Hybrid sharding: replica d (data- and context-parallel) is member d % S of shard group d / S
  // (Plan::shard_group);
  // the replicate group holds the ranks of equal d % S. Both are split from the data-parallel
  // group, every member in the same order.
  std::shared_ptr<Communicator> shard = grid.dp(), replicate;
  if (plan.ep > 1) {
    // Expert parallelism: the shard group is the replicas of this rank's experts, the replicate
    // group its expert group (Plan::dp_shard).
    shard = expert_replicas;
    replicate = ep;
  } else if (plan.dp_replicate() > 1) {
    const int S = plan.dp_shard(), d = grid.shape().replica(me);
    shard = grid.dp()->split(d / S, d % S);
    replicate = grid.dp()->split(d % S, d / S);
  }
  auto sync = std::make_unique<ZeroSync>(shard, layout.total(), std::move(pieces), dpo, forced,
                                         replicate, replicate ? grid.dp() : nullptr);
  *zero = sync.get();
  return sync;
}

// Compute thread k's model communication points: its tp region (thread 0 on the grid's tp
// communicator, every further thread on a split of its own, so the k-th threads of the tp ranks
// pair up in one issue order), under context parallelism its ring, likewise over the cp group
// (thread k of every cp rank holds chunks of the same sequences), and under expert parallelism its
// expert group, likewise. Null when it has none.
tp::Region* thread_region(const parallel::ProcessGrid* grid, const parallel::Plan& plan, int k, Parts& parts) {
  tp::Region* region = nullptr;
  if (plan.tp > 1) {
    auto comm = k == 0 ? grid->tp() : grid->tp()->split(0, grid->tp()->rank());
    parts.regions.push_back(std::make_unique<tp::CommRegion>(comm));
    region = parts.regions.back().get();
  }
  if ((plan.cp > 1 || plan.ep > 1) && !region) {
    parts.solo_regions.push_back(tp::solo());
    region = parts.solo_regions.back().get();
  }
  if (plan.cp > 1) {
    auto comm = k == 0 ? grid->cp() : grid->cp()->split(0, grid->cp()->rank());
    region->set_cp_group(std::make_shared<cp::Group>(comm, plan.cp_comm));
  }
  // Every thread's on a split of its own: parts.ep also carries ZeRO's replicate all-reduces,
  // issued at other points of the step than the MoE layers' all-to-alls.
  if (plan.ep > 1) region->set_ep_group(parts.ep->split(0, parts.ep->rank()));
  return region;
}

std::unique_ptr<model::LocalModel> build_model(const Options& opt, const parallel::ProcessGrid* grid, Parts& parts) {
  const parallel::Plan& plan = opt.plan;
  const int local_batch = plan.micro_batch(opt.batch_size);
  const int seq_len = plan.local_seq_len(opt.seq_len);
  const parallel::Coords me = grid ? grid->coords() : parallel::Coords{};
  const int ep_rank = grid ? plan.ep_rank(grid->shape().replica(me)) : 0;
  // The compute threads split the batch; OpenBLAS stays on one thread per call unless there are
  // more threads than sequences to split.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 0 && opt.threads > cores)
    log::warn(Subsys::kTrain, "--threads {} is more than the {} processors here: compute threads will share cores",
              opt.threads, cores);
  if (plan.pp == 1 && opt.threads > local_batch)
    log::warn(Subsys::kTrain,
              "--threads {}: each rank's micro-batch has {} sequences, so {} compute threads split it "
              "(OpenBLAS gets the rest)",
              opt.threads, local_batch, local_batch);
  if (plan.pp > 1) {
    // A pipeline stage: one compute thread runs the schedule; each matmul (OpenBLAS or oneDNN)
    // and the optimizer's loops get the threads.
    kernels::set_gemm_threads(opt.threads);
    tp::Region* region = thread_region(grid, plan, 0, parts);
    return std::make_unique<pipeline::PipelineModel>(opt.model, plan.schedule, plan.pipeline(), me.pp, plan.tp, me.tp,
                                                     local_batch, seq_len, opt.threads, region, grid->pp(),
                                                     grid->embedding(), plan.cp, me.cp, plan.ep, ep_rank);
  }
  const int model_threads = model::OneStageModel::threads_for(std::min(opt.threads, local_batch), local_batch);
  kernels::set_gemm_threads(opt.threads / model_threads);
  std::vector<tp::Region*> per_thread;
  if (plan.tp > 1 || plan.cp > 1 || plan.ep > 1)
    for (int k = 0; k < model_threads; ++k) per_thread.push_back(thread_region(grid, plan, k, parts));
  return std::make_unique<model::OneStageModel>(opt.model, local_batch, seq_len, model_threads,
                                                plan.placement(opt.model, me.tp, me.pp, me.cp, ep_rank), per_thread);
}

}  // namespace

void check_options(const Options& opt, const parallel::ProcessGrid* grid) {
  const parallel::GridShape shape = opt.plan.grid();
  parallel::check_layout(shape, grid ? grid->shape().world() : 1);
  if (grid && !(grid->shape().dp == shape.dp && grid->shape().tp == shape.tp && grid->shape().pp == shape.pp))
    throw internal_error("trainer options {} differ from the grid {}", shape.describe(), grid->shape().describe());
  parallel::check(opt.plan, opt.model, opt.batch_size);
  if (opt.metrics_moe_loads && !opt.model.moe())
    throw usage_error("--metrics-moe-loads: the model has no experts (--arch {})", opt.model.arch);
  if (opt.metrics_moe_loads && opt.metrics_jsonl.empty())
    throw usage_error("--metrics-moe-loads writes into --metrics-jsonl's lines: give --metrics-jsonl FILE");
  // The bf16 kernels are chosen before anything runs (a bad --bf16-kernels is a usage error).
  if (opt.model.precision == model::Precision::kBf16) kernels::set_bf16_path(kernels::parse_bf16_path(opt.bf16_kernels));
}

parallel::MemoryCount memory_need(const Options& opt, int tp_rank) {
  parallel::MemoryInputs in;
  in.threads = opt.threads;
  in.tp_rank = tp_rank;
  in.bf16_copy_half = kernels::bf16_path() == kernels::Bf16Path::kOneDnn;
  return parallel::memory(opt.plan, opt.model, opt.batch_size, opt.seq_len, in);
}

void check_memory(const Options& opt, int tp_rank) {
  const double need = memory_need(opt, tp_rank).total();
  const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > have)
    throw usage_error("{} with micro-batches of {} x {} needs about {:.1f} GB per rank (weights, gradients, AdamW "
                      "state, activations, buffers) but this host has {:.1f} GB; use a smaller model or batch, "
                      "more --micro-batches{}, or shard it with --tp or --pp",
                      opt.model.describe(), opt.plan.micro_batch(opt.batch_size), opt.seq_len, need / 1e9,
                      have / 1e9, opt.plan.pp > 1 ? " under --schedule 1f1b" : "");
}

Parts build(const Options& opt, const parallel::ProcessGrid* grid) {
  Parts parts;
  const parallel::Coords me = grid ? grid->coords() : parallel::Coords{};
  const parallel::Plan& plan = opt.plan;
  ZeroSync* zero = nullptr;
  const int replica = grid ? grid->shape().replica(me) : 0, ep_rank = plan.ep_rank(replica);
  parts.whole = plan.tp > 1 || plan.pp > 1 ? grid->model_parallel() : nullptr;
  if (plan.ep > 1) {
    // Each split is collective over its parent, in this order on every rank.
    parts.ep = grid->dp()->split(plan.ep_group(replica), ep_rank);
    if (plan.replicas() > plan.ep) parts.expert_replicas = grid->dp()->split(ep_rank, plan.ep_group(replica));
    parts.whole = grid->world()->split(plan.ep_group(replica), grid->rank());
  }
  if (grid && grid->dp())
    parts.sync = build_sync(opt, *grid,
                            model::ParamLayout(opt.model, plan.placement(opt.model, me.tp, me.pp, me.cp, ep_rank)),
                            parts.expert_replicas, parts.ep, &zero);
  parts.model = build_model(opt, grid, parts);
  model::LocalModel& m = *parts.model;
  m.init(opt.seed);
  if (!opt.init.empty()) io::load_gpt2(opt.init, m.layout(), m.params());
  if (!opt.init_hf.empty()) {
    // Each rank reads only its own slices' bytes (hf_dir.h); the peak resident set after the load
    // is what bench/results/2026-12-06-hf-load.md compares across layouts.
    const auto t0 = std::chrono::steady_clock::now();
    io::load_hf(opt.init_hf, m.layout(), m.params());
    log::info(log::Subsys::kTrain, "loaded --init-hf {} ({} parameters on this rank) in {:.2f} s; peak RSS {:.1f} MB",
              opt.init_hf, m.layout().total(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              double(io::peak_rss_bytes()) / 1e6);
  }
  // ZeRO-3: from the whole initial weights each rank keeps its shard. Gathers run on their own
  // communicator over the data-parallel group, so they never queue behind the gradients'
  // reduce-scatters on grid.dp() (each communicator runs its operations in issue order).
  // ZeRO-2/3 with one backward per step on one compute thread: a gradient window instead of the
  // whole buffer (more backwards per step must each add into every element of it first).
  if (zero && plan.zero_stage() >= 2 && plan.pp == 1 && plan.micro_batches == 1 && m.threads() == 1 &&
      model::GradWindow::fits(m.layout())) {
    m.use_grad_window(zero->plan(), zero->plan().owned_elements(zero->rank()));
    zero->use_window(m.grad_window(), m.grads());
  }
  if (zero && plan.zero_stage() == 3) m.shard_weights(zero->plan(), zero->comm()->split(0, zero->comm()->rank()), plan.prefetch);
  const optim::AdamWConfig cfg{opt.beta1, opt.beta2, 1e-8f, opt.weight_decay, opt.grad_clip};
  // The norm sums over the ranks that hold the rest of this replica's model (and, under expert
  // parallelism, the other experts).
  const std::shared_ptr<Communicator>& model_parallel = parts.whole;
  if (zero) {
    auto adamw = std::make_unique<ZeroAdamW>(m.layout(), cfg, *zero, model_parallel, plan.zero_stage());
    adamw->set_storage(m.param_storage(), plan.zero_stage() >= 2 ? optim::Storage::kCompact : optim::Storage::kWhole);
    parts.optimizer = std::move(adamw);
  }
  else
    parts.optimizer = std::make_unique<optim::AdamW>(
        m.layout(), cfg,
        optim::NormGroup{optim::norm_pieces(m.layout(), plan.tp, plan.pp, me.tp, me.pp, plan.ep, ep_rank), model_parallel});
  return parts;
}

}  // namespace trn::train
