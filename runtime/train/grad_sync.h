// What data parallelism plugs into the trainer (built by builder.h). The model calls
// grads_ready() (through model::StepBatches::ready) during the backward of the step's last
// micro-batch each time a prefix of the gradient buffer becomes
// final on this rank (ranges contiguous and increasing, from 0 to n), so an implementation can
// start bucket all-reduces while earlier layers still compute; finish() must return once every
// gradient holds the mean over the data-parallel ranks, or, under ZeRO-1, once this rank's shard
// of them does (averaged(); zero_sync.h). Which one runs is the plan's (Plan::sharded()); the
// builder, which makes it, is the only code that knows its type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/optim/zero.h"

namespace trn::train {

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
  // Sums v[0, n) over the ranks, in place (the MoE layers' counts).
  virtual void sum(double* v, size_t n) = 0;
  // The ranges of the buffer where finish() leaves the mean (null: all of it).
  virtual const std::vector<optim::Range>* averaged() const { return nullptr; }

  // What the sync did over the run (the log's data-parallel line).
  struct Stats {
    int64_t steps = 0;
    int64_t buckets_started_in_backward = 0;  // collectives that overlapped backward
    int64_t buckets_started_in_finish = 0;
    double exposed_s = 0.0;  // time finish() spent waiting for communication
    // Gradients whose collective had already completed when backward ended (finish() was
    // called), out of all gradients reduced: the share of communication hidden behind backward.
    size_t reduced_in_backward = 0, reduced = 0;
  };
  virtual const Stats& stats() const = 0;
  virtual size_t num_buckets() const = 0;
};

}  // namespace trn::train
