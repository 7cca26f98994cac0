// `trn-plan calibrate`: this machine's compute, measured with trn's own kernels at a model's
// shapes, for the planner's local clusters (cluster.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/plan/cluster.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::plan {

struct CalibrateOptions {
  int max_tp = 8;         // tp sizes measured: the model's divisors up to this
  int max_batch = 16;     // micro-batch sizes measured: powers of two up to this
  int repeats = 3;        // each time is the median of this many runs (after one warm-up)
  std::string trn_train;  // the trn-train program whose base memory is measured ("" skips it)
  std::string prober;     // the trn-plan program whose probe-link measures the links ("" skips it)
  bool quiet = false;
};

// A region of `size` ranks that communicates nothing (this rank's compute alone, as rank 0 of a
// tensor-parallel group of that size) and records the element count of every call, in order.
class RecordingRegion : public tp::Region {
 public:
  explicit RecordingRegion(int size) : size_(size) {}
  int size() const override { return size_; }
  int rank() const override { return 0; }
  void sum(float*, size_t n) override { calls.push_back({n}); }
  void sum(double*, size_t n) override { calls.push_back({n}); }
  void max(float*, size_t n) override { calls.push_back({n}); }
  void max(double*, size_t n) override { calls.push_back({n}); }
  void gather(float*, size_t n) override { calls.push_back({n * size_, true}); }
  void gather(double*, size_t n) override { calls.push_back({n * size_, true}); }
  void scatter_sum(float*, size_t n) override { calls.push_back({n * size_, true}); }
  void scatter_sum(double*, size_t n) override { calls.push_back({n * size_, true}); }
  std::vector<TpCall> calls;

 private:
  int size_;
};

// The pieces of model c (embedding, one block, head) as shard 0 of tp, forward and backward
// over micro-batches of `batch` sequences of seq_len tokens, timed (the median of `repeats`, as a
// step's typical time is what the plan predicts), then
// scaled so that they add up to the whole model's forward and backward timed the same way (a
// piece alone runs from warm caches).
// calls: when not null, the region's calls of one forward and backward of each piece, by piece
// ("embedding_fwd", "block_fwd", "block_bwd", "head_fwd", "head_bwd"); the times are then not scaled.
PieceTimes time_pieces(const model::Config& c, int tp, int batch, int seq_len, int repeats,
                       std::vector<std::pair<std::string, std::vector<TpCall>>>* calls = nullptr);

// `trn-plan probe-link`: this process as one of 2 to 64 ranks (FileStore bootstrap: TRN_STORE_DIR,
// TRN_RANK, TRN_WORLD_SIZE; the fabric as TRN_FABRIC_* say) timing a ring all-reduce of each
// size from 4 KiB to 4 MiB, each call after a run of model c's own block forward, as a step's
// collectives come between its kernels. Rank 0 prints "SIZE_BYTES MICROSECONDS" per size, the
// median of `iters` calls (then their mean and 90th percentile). behind: each call is issued
// before the block forward and waited for after it, and its own time (issued to the engine's
// end) is measured, as a step's hidden collectives run while its ranks compute.
void probe_link(const model::Config& c, int seq_len, int iters, bool behind = false);

// Everything the local cluster file holds for model c at seq_len.
Calibration calibrate(const model::Config& c, int seq_len, const CalibrateOptions& opt);

}  // namespace trn::plan
