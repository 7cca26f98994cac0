// From (options, process grid) to what a rank trains with: its part of the model (the one-process
// model or a pipeline stage, model::LocalModel), the data-parallel gradient sync (all-reduce or
// ZeRO-1's reduce-scatter) and the optimizer (AdamW, or ZeRO-1's AdamW over the owned slices).
// The trainer runs them through their interfaces; only this file knows which ones run.
#pragma once

#include <memory>
#include <vector>

#include "runtime/model/model.h"
#include "runtime/optim/optimizer.h"
#include "runtime/parallel/grid.h"
#include "runtime/parallel/plan.h"
#include "runtime/tensor_parallel/region.h"
#include "runtime/train/grad_sync.h"
#include "runtime/train/options.h"

namespace trn::train {

// Declared in the order they are built; each may point at the ones before it (the model at the
// regions, the optimizer at the sync), so they are destroyed in the reverse order.
struct Parts {
  std::vector<std::unique_ptr<tp::CommRegion>> regions;  // one per compute thread under TP
  // Under context parallelism without TP: one region of its own per compute thread, carrying its
  // ring (under TP the thread's CommRegion carries it).
  std::vector<std::unique_ptr<tp::Region>> solo_regions;
  // Expert parallelism (Plan::ep > 1): the expert group (this rank's ep peers, in ep-rank order),
  // the replicas holding the same experts (null: none but this rank), and the ranks holding one
  // whole model between them (every tp, pp and ep rank of the expert group: the gradient norm's
  // and --save's group). Without ep, `whole` is the grid's model-parallel group.
  std::shared_ptr<Communicator> ep, expert_replicas, whole;
  std::unique_ptr<GradientSync> sync;                    // null when dp is 1
  std::unique_ptr<model::LocalModel> model;              // initialised (seed, then --init)
  std::unique_ptr<optim::Optimizer> optimizer;
};

// Checks the options against the grid (null: one process) and picks the bf16 kernels: usage
// errors for a layout or model that does not fit.
void check_options(const Options& opt, const parallel::ProcessGrid* grid);
// What this run needs per rank (the pipeline rank that needs the most): parallel::memory, the
// count trn-plan reports, with this run's threads and bf16 kernels.
parallel::MemoryCount memory_need(const Options& opt, int tp_rank);
// Usage error when memory_need is more than this host has.
void check_memory(const Options& opt, int tp_rank);
// Builds this rank's parts (collective over the grid's tp group when it splits one per thread).
Parts build(const Options& opt, const parallel::ProcessGrid* grid);

}  // namespace trn::train
