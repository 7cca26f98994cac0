// Data-parallel gradient averaging (DESIGN.md layer 5): the gradient buffer is cut into buckets
// of --bucket-mb; each bucket's all-reduce (average) starts as soon as backward has finalised its
// last gradient, on the communicator's thread, while backward goes on with earlier layers.
// finish() waits for the rest. Every rank ends the step with bit-identical gradients (the
// collectives reduce in a fixed order and send every rank the same result).
//
// With GradComm::kBF16 each bucket travels as bfloat16 (half the bytes) and is reduced in f32
// with correct rounding; the averaged gradient is widened back to f32.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "runtime/train/grad_sync.h"

namespace trn::dist {

enum class GradComm { kF32, kBF16 };

struct SyncStats {
  int64_t steps = 0;
  double exposed_s = 0;  // time finish() waited for all-reduces after backward ended
  int64_t buckets = 0;   // all-reduces issued
};

class DataParallelSync : public train::GradientSync {
 public:
  DataParallelSync(std::shared_ptr<Communicator> comm, size_t bucket_bytes, GradComm dtype);

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  void grads_ready(float* grads, size_t begin, size_t end) override;
  void finish(float* grads, size_t n) override;
  double mean(double value) override;

  const SyncStats& stats() const { return stats_; }
  // Seconds one blocking all-reduce of n gradients takes here (median of a few), to tell how
  // much of the communication the overlap hides.
  double measure_allreduce_s(size_t n, int repeats);

 private:
  void launch(float* grads, size_t begin, size_t end);

  struct Bucket {
    size_t begin, end;
    WorkPtr work;
    std::vector<uint16_t> staging;  // bf16 copy when dtype is kBF16
  };
  std::shared_ptr<Communicator> comm_;
  size_t bucket_elems_;
  GradComm dtype_;
  size_t launched_ = 0;  // gradients [0, launched_) have an all-reduce in flight this step
  std::vector<Bucket> inflight_;
  SyncStats stats_;
};

}  // namespace trn::dist
