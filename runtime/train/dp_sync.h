// Data-parallel gradient synchronization: the gradient buffer is cut into fixed buckets
// (bucket_bytes of f32, the last one shorter) and each bucket's all-reduce (mean over the ranks)
// is started as soon as backward reports it final (GradientSync::grads_ready), so communication
// overlaps the backward of earlier layers. finish() starts what is left and waits for all.
// The wire format (--grad-comm): f32; bf16 (half the bytes, each gradient rounded to nearest
// even before the all-reduce, whose partial sums are bf16 too); or fp8, the e4m3 all-reduce
// (Communicator::all_reduce_e4m3: a quarter of the bytes, each rank's gradients rounded once to
// e4m3 at a scale per 128 elements, summed in f32, and the mean rounded once more).
//
//   trn::train::DataParallelSync sync(grid.dp(), model.num_params(), {.bucket_bytes = 25 << 20});
//   model.forward_backward(in, tg, scale, [&](size_t b, size_t e) { sync.grads_ready(model.grads(), b, e); });
//   sync.finish(model.grads(), model.num_params());
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "runtime/parallel/plan.h"
#include "runtime/train/grad_sync.h"

namespace trn::train {

// The wire format is the plan's (parallel/plan.h), parsed from --grad-comm by the options.
using parallel::GradWire;

struct DataParallelOptions {
  size_t bucket_bytes = size_t(25) << 20;
  GradWire wire = GradWire::kF32;
  Fp8Format fp8_format = Fp8Format::kOCP;  // the fp8 wire's E4M3 format (collectives/fp8.h)
  // Expert parallelism (parallel::Plan::ep): the buffer's ranges of experts' tensors (ascending,
  // disjoint), whose buckets are averaged over `experts` (the replicas holding the same experts;
  // null: none but this rank) instead of all ranks, then scaled by expert_scale (1 / ep: each
  // expert rank summed its expert group's tokens' contributions). No bucket spans a range's edge.
  struct Range {
    size_t begin = 0, end = 0;
  };
  std::vector<Range> expert_ranges = {};
  std::shared_ptr<Communicator> experts = nullptr;
  float expert_scale = 1.0f;
};

class DataParallelSync : public GradientSync {
 public:
  DataParallelSync(std::shared_ptr<Communicator> comm, size_t num_params,
                   DataParallelOptions opt = {});

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  void grads_ready(float* grads, size_t begin, size_t end) override;
  void finish(float* grads, size_t n) override;
  double mean(double value) override;
  void sum(double* v, size_t n) override;

  const Stats& stats() const override { return stats_; }
  size_t num_buckets() const override { return bounds_.size() - 1; }

 private:
  void start(float* grads, size_t bucket);

  std::shared_ptr<Communicator> comm_;
  DataParallelOptions opt_;
  std::vector<size_t> bounds_;  // bucket k is [bounds_[k], bounds_[k+1])
  std::vector<char> expert_;    // bucket k holds experts' gradients (DataParallelOptions::expert_ranges)
  std::vector<WorkPtr> pending_;
  AlignedVector<uint16_t> staging_;  // bf16 copies of the gradients, 64-byte aligned for the wire
  size_t next_ = 0;                // next bucket to start
  Stats stats_;
};

}  // namespace trn::train
