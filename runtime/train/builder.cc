#include "runtime/train/builder.h"

#include <unistd.h>

#include <algorithm>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
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

int micro_batch_size(const Options& opt) { return opt.batch_size / opt.dp / opt.micro_batches; }

pipeline::Shape pipeline_shape(const Options& opt) { return {opt.pp, opt.micro_batches, opt.virtual_stages}; }

// The tensors a rank holds: its tp shard of every block, or of its pipeline stage's chunks.
model::Placement placement_of(const Options& opt, int tp_rank, int pp_rank) {
  model::Placement placement{opt.tp, tp_rank, {}};
  if (opt.pp > 1) placement.chunks = pipeline::chunks_of(opt.model, pipeline_shape(opt), pp_rank);
  return placement;
}

// The data-parallel sync of a buffer of this layout: bucketed all-reduce, or ZeRO-1's
// reduce-scatter whose buckets end on the norm's pieces.
std::unique_ptr<GradientSync> build_sync(const Options& opt, const parallel::ProcessGrid& grid,
                                         const model::ParamLayout& layout) {
  DataParallelOptions dpo;
  dpo.bucket_bytes = size_t(opt.bucket_mb * 1024 * 1024);
  dpo.wire = parse_grad_wire(opt.grad_comm);
  if (!opt.zero) return std::make_unique<DataParallelSync>(grid.dp(), layout.total(), dpo);
  // The tied wte starts and ends a bucket, so the first and the last stage, whose buffers differ,
  // slice it alike and can sum its gradient slice by slice over the embedding group.
  std::vector<size_t> forced;
  if (const model::TensorSpec* wte = layout.tied(); wte && opt.pp > 1) forced = {wte->offset, wte->offset + wte->numel};
  const parallel::Coords me = grid.coords();
  return std::make_unique<ZeroSync>(grid.dp(), layout.total(), optim::norm_pieces(layout, opt.tp, opt.pp, me.tp, me.pp),
                                    dpo, forced);
}

std::unique_ptr<model::LocalModel> build_model(const Options& opt, const parallel::ProcessGrid* grid,
                                               std::vector<std::unique_ptr<tp::CommRegion>>& regions) {
  const int local_batch = micro_batch_size(opt);
  const parallel::Coords me = grid ? grid->coords() : parallel::Coords{};
  // The compute threads split the batch; OpenBLAS stays on one thread per call unless there are
  // more threads than sequences to split.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores > 0 && opt.threads > cores)
    log::warn(Subsys::kTrain, "--threads {} is more than the {} processors here: compute threads will share cores",
              opt.threads, cores);
  if (opt.pp == 1 && opt.threads > local_batch)
    log::warn(Subsys::kTrain,
              "--threads {}: each rank's micro-batch has {} sequences, so {} compute threads split it "
              "(OpenBLAS gets the rest)",
              opt.threads, local_batch, local_batch);
  if (opt.pp > 1) {
    // A pipeline stage: one compute thread runs the schedule; each matmul (OpenBLAS or oneDNN)
    // and the optimizer's loops get the threads.
    kernels::set_gemm_threads(opt.threads);
    if (opt.tp > 1) regions.push_back(std::make_unique<tp::CommRegion>(grid->tp()));
    return std::make_unique<pipeline::PipelineModel>(
        opt.model, pipeline::parse_kind(opt.pipeline_schedule), pipeline_shape(opt), me.pp, opt.tp, me.tp,
        local_batch, opt.seq_len, opt.threads, regions.empty() ? nullptr : regions[0].get(), grid->pp(),
        grid->embedding());
  }
  const int model_threads = model::OneStageModel::threads_for(std::min(opt.threads, local_batch), local_batch);
  kernels::set_gemm_threads(opt.threads / model_threads);
  std::vector<tp::Region*> per_thread;
  if (opt.tp > 1) {
    // Thread 0 uses the grid's tp communicator; every further thread a split of its own, so the
    // k-th threads of the tp ranks pair up in one issue order.
    for (int k = 0; k < model_threads; ++k) {
      auto comm = k == 0 ? grid->tp() : grid->tp()->split(0, grid->tp()->rank());
      regions.push_back(std::make_unique<tp::CommRegion>(comm));
      per_thread.push_back(regions.back().get());
    }
  }
  return std::make_unique<model::OneStageModel>(opt.model, local_batch, opt.seq_len, model_threads,
                                      placement_of(opt, me.tp, me.pp), per_thread);
}

}  // namespace

void check_options(const Options& opt, const parallel::ProcessGrid* grid) {
  const parallel::GridShape shape{opt.dp, opt.tp, opt.pp};
  parallel::check_layout(shape, grid ? grid->shape().world() : 1);
  if (grid && !(grid->shape().dp == shape.dp && grid->shape().tp == shape.tp && grid->shape().pp == shape.pp))
    throw internal_error("trainer options {} differ from the grid {}", shape.describe(), grid->shape().describe());
  model::check_tensor_parallel(opt.model, opt.tp);
  // The bf16 kernels are chosen before anything runs (a bad --bf16-kernels is a usage error).
  if (opt.model.precision == model::Precision::kBf16) kernels::set_bf16_path(kernels::parse_bf16_path(opt.bf16_kernels));
}

void check_memory(const Options& opt, int tp_rank) {
  const int local_batch = micro_batch_size(opt);  // sequences per micro-batch
  const pipeline::Shape shape = pipeline_shape(opt);
  // AdamW's moments are 2 floats per parameter, or per owned parameter under ZeRO-1.
  const double moments = 2.0 / (opt.zero ? opt.dp : 1);
  // The pipeline's message buffers.
  const double N = double(local_batch) * opt.seq_len, C = opt.model.d_model;
  const double buffers = opt.pp > 1 ? 4.0 * 4.0 * opt.virtual_stages * opt.micro_batches * N * C : 0.0;
  // Per pipeline rank (the one that needs the most counts): parameters, gradients and AdamW's
  // moments, plus the activation slots and scratch its stages hold, as they count them.
  double need = 0;
  for (int r = 0; r < opt.pp; ++r) {
    std::vector<int> slots{1};
    if (opt.pp > 1) slots = pipeline::plan_slots(pipeline::parse_kind(opt.pipeline_schedule), r, shape).slots_needed;
    const model::ParamLayout lay(opt.model, placement_of(opt, tp_rank, r));
    double activations = 0;
    for (size_t c = 0; c < slots.size(); ++c)
      activations += double(model::Stage<float>::activation_bytes(lay, local_batch, opt.seq_len, slots[c], int(c)));
    need = std::max(need, 4.0 * (2.0 + moments) * double(lay.total()) + activations + buffers);
  }
  const double have = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
  if (have > 0 && need > have)
    throw usage_error("{} with micro-batches of {} x {} needs about {:.1f} GB per rank (weights, gradients, AdamW "
                      "state, activations) but this host has {:.1f} GB; use a smaller model or batch, "
                      "more --micro-batches{}, or shard it with --tp or --pp",
                      opt.model.describe(), local_batch, opt.seq_len, need / 1e9, have / 1e9,
                      opt.pp > 1 ? " under --schedule 1f1b" : "");
}

Parts build(const Options& opt, const parallel::ProcessGrid* grid) {
  Parts parts;
  const parallel::Coords me = grid ? grid->coords() : parallel::Coords{};
  ZeroSync* zero = nullptr;
  if (grid && grid->dp()) {
    parts.sync = build_sync(opt, *grid, model::ParamLayout(opt.model, placement_of(opt, me.tp, me.pp)));
    zero = parts.sync->zero();
  }
  parts.model = build_model(opt, grid, parts.regions);
  model::LocalModel& m = *parts.model;
  m.init(opt.seed);
  if (!opt.init.empty()) io::load_gpt2(opt.init, m.layout(), m.params());
  const optim::AdamWConfig cfg{opt.beta1, opt.beta2, 1e-8f, opt.weight_decay, opt.grad_clip};
  // The norm sums over the ranks that hold the rest of this replica's model.
  std::shared_ptr<Communicator> model_parallel = opt.tp > 1 || opt.pp > 1 ? grid->model_parallel() : nullptr;
  if (zero)
    parts.optimizer = std::make_unique<ZeroAdamW>(m.layout(), cfg, *zero, model_parallel);
  else
    parts.optimizer = std::make_unique<optim::AdamW>(
        m.layout(), cfg, optim::NormGroup{optim::norm_pieces(m.layout(), opt.tp, opt.pp, me.tp, me.pp), model_parallel});
  return parts;
}

}  // namespace trn::train
