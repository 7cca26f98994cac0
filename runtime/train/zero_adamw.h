// ZeRO's optimizer (--zero 1, 2, 3): AdamW behind the same Optimizer interface as the unsharded one,
// with state for this rank's slices of the buffer only (ZeroSync::owned(), where finish() left
// the data-parallel mean). The norm adds ZeroSync::piece_sums (bit-identical to the unsharded
// norm, zero.h) over the model-parallel group; update() clips and updates the owned slices,
// then all-gathers every rank's slices (ZeroSync::gather_params), so params is whole again.
// Checkpoints keep the owned slices (shard()). With compact grads (set_storage) the norm reads
// the compact shard; with compact params update() leaves the updated shard there, ungathered.
#pragma once

#include <memory>
#include <string>

#include "runtime/optim/adamw.h"
#include "runtime/train/zero_sync.h"

namespace trn::train {

class ZeroAdamW : public optim::AdamW {
 public:
  // sync must outlive the optimizer; norm: its pieces are sync.pieces(), comm the model-parallel
  // group (null when the replica is one rank).
  ZeroAdamW(const model::ParamLayout& layout, optim::AdamWConfig cfg, ZeroSync& sync,
            std::shared_ptr<Communicator> model_parallel, int stage = 1);

  double grad_norm(const float* grads, ThreadPool& pool) override;
  void update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) override;
  std::string describe() const override;

 private:
  ZeroSync& sync_;
  optim::NormGroup norm_;
  int stage_;  // 1-3, for the log
};

}  // namespace trn::train
