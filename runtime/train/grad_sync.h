// What data parallelism plugs into the trainer (built by builder.h). The model calls
// grads_ready() (through model::StepBatches::ready) during the backward of the step's last
// micro-batch each time a prefix of the gradient buffer becomes
// final on this rank (ranges contiguous and increasing, from 0 to n), so an implementation can
// start bucket all-reduces while earlier layers still compute; finish() must return once every
// gradient holds the mean over the data-parallel ranks, or, under ZeRO-1 (zero() not null), once
// this rank's shard of them does (averaged(); zero_sync.h).
#pragma once

#include <cstddef>
#include <vector>

#include "runtime/optim/zero.h"

namespace trn::train {

class ZeroSync;

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Gradient elements [begin, end) of `grads` are final on this rank for this step.
  virtual void grads_ready(float* grads, size_t begin, size_t end) = 0;
  // Returns when grads[0, n) holds the mean over ranks.
  virtual void finish(float* grads, size_t n) = 0;
  // Mean of a per-rank value over the ranks (used for the logged loss).
  virtual double mean(double value) = 0;
  // The ranges of the buffer where finish() leaves the mean (null: all of it).
  virtual const std::vector<optim::Range>* averaged() const { return nullptr; }
  // Non-null when gradients and optimizer state are sharded over the ranks (ZeRO-1).
  virtual ZeroSync* zero() { return nullptr; }
};

}  // namespace trn::train
