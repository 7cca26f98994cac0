// ZeRO-1 over the data-parallel communicator (--zero 1): each bucket of the gradient buffer is
// reduce-scattered (mean over the ranks) as soon as backward reports it final, so every rank
// ends the step with only its slices of the gradient averaged (runtime/optim/zero.h has the
// partition). Its optimizer (ZeroAdamW, zero_adamw.h) then clips and runs AdamW on those slices
// alone, holding AdamW's state for them only, and gather_params() all-gathers the updated
// parameters so every rank again holds the whole buffer.
//
// A ring all-reduce is a reduce-scatter followed by an all-gather, and AdamW is element-wise, so
// with 2 ranks (a + b is the same sum in either order) the parameters are bit-identical to the
// all-reduce path's; piece_sums() makes the gradient norm bit-identical too. With more ranks the
// gradient's sums run in another (fixed) order than the all-reduce's, so results agree to
// rounding.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "runtime/model/grad_window.h"
#include "runtime/optim/zero.h"
#include "runtime/train/dp_sync.h"
#include "runtime/train/grad_sync.h"
#include "runtime/util/thread_pool.h"

namespace trn::train {

class ZeroSync : public GradientSync {
 public:
  // pieces: the gradient norm's pieces of this rank's buffer (optim::norm_pieces); buckets end
  // on their boundaries. forced: buffer positions where a bucket must end as well (the tied wte's
  // start and end under pipeline parallelism, so both stages slice it alike).
  //
  // Hybrid sharding (--shard-group): comm is this rank's shard group, replicate the group of the
  // ranks holding the same shard in the other shard groups, all the whole data-parallel group
  // (the loss's mean). Each bucket's mean over the shard group (the reduce-scatter) then has its
  // mean over the replicas taken (an all-reduce of the owned slice on replicate), issued once the
  // reduce-scatter completed, in bucket order. Null replicate (and all): plain ZeRO over comm.
  ZeroSync(std::shared_ptr<Communicator> comm, size_t num_params, optim::NormPieces pieces,
           DataParallelOptions opt = {}, const std::vector<size_t>& forced = {},
           std::shared_ptr<Communicator> replicate = nullptr, std::shared_ptr<Communicator> all = nullptr);

  // Waits out every operation still in flight (a step that threw leaves some reading or writing
  // buffers this object or the model owns; on a failed transport they end at once).
  ~ZeroSync() override;

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  void grads_ready(float* grads, size_t begin, size_t end) override;
  // Returns when this rank's slices of grads hold the mean over the ranks (the rest of the
  // buffer holds this rank's own gradients, to be ignored).
  void finish(float* grads, size_t n) override;
  double mean(double value) override;
  void sum(double* v, size_t n) override;
  const std::vector<optim::Range>* averaged() const override { return &owned_; }

  const optim::ZeroPlan& plan() const { return plan_; }
  // The shard group's communicator (the partition's ranks).
  const std::shared_ptr<Communicator>& comm() const { return comm_; }
  // The shard groups that replicate this one (1 without hybrid sharding).
  int replicas() const { return replicate_ ? replicate_->size() : 1; }
  const std::vector<optim::Range>& owned() const { return owned_; }
  const optim::NormPieces& pieces() const { return pieces_; }
  // The sum of squares of every norm piece (uncounted ones 0) of the averaged gradient, on every
  // rank, each computed exactly as the unsharded loop does: collective over the group. grads is
  // the whole buffer, or (kCompact) this rank's compact shard (zero.h), read at each fragment's
  // precomputed position: the same elements in the same order, so the same sums.
  std::vector<double> piece_sums(const float* grads, ThreadPool& pool,
                                 optim::Storage storage = optim::Storage::kWhole);
  // After this rank updated its slices of params: every rank's slices to every rank (in place).
  void gather_params(float* params);

  const Stats& stats() const override { return stats_; }
  size_t num_buckets() const override { return plan_.buckets().size(); }

  // The model's gradient window (ZeRO-2/3 with one backward per step): each bucket is copied out
  // of it when the backward reports it final (window->copy) and reduce-scattered from that copy
  // into owned (this rank's compact shard, ZeroPlan::owned_offset), so finish() leaves the mean
  // there; the grads pointers passed to grads_ready and finish are then unused. At most
  // kMaxStaged copies are in flight: a further bucket first waits for the oldest.
  void use_window(model::GradWindow* window, float* owned);
  static constexpr size_t kMaxStaged = 4;

 private:
  void start(float* grads, size_t bucket);
  void start_window(size_t bucket);
  // Window mode, once bucket k's reduce-scatter completed: the tail's owner copies the tail into
  // its shard, and the bucket's copy is freed.
  void retire(size_t k);
  // Where bucket k's slice and tail hold this rank's reduced values (fp32, or bf16 under the
  // bf16 wire): in the whole buffer, in its bf16 staging, or in the compact shard.
  float* slice_f32(float* grads, size_t k, bool tail);
  uint16_t* slice_bf16(size_t k, bool tail);
  // Hybrid: issues the replicas' all-reduce of each bucket whose reduce-scatter completed, in
  // bucket order (wait: waits for them, through bucket `through`).
  void replicate_ready(float* grads, bool wait, size_t through);

  std::shared_ptr<Communicator> comm_, replicate_, all_;
  DataParallelOptions opt_;
  optim::NormPieces pieces_;
  optim::ZeroPlan plan_;
  std::vector<optim::Range> owned_;
  std::vector<std::vector<optim::Fragment>> fragments_;  // per bucket, this rank's
  std::vector<WorkPtr> pending_, pending_tail_, replicated_;
  std::vector<char> expert_;  // bucket k holds experts' gradients (DataParallelOptions::expert_ranges)
  size_t next_replicated_ = 0;  // hybrid: buckets [0, next_replicated_) have their all-reduce issued
  AlignedVector<uint16_t> staging_;  // bf16 copies of the gradients
  model::GradWindow* window_ = nullptr;
  float* shard_ = nullptr;                       // window mode: the compact gradient shard
  AlignedVector<uint16_t> owned_h_;              // window mode, bf16 wire: its bf16 form
  // Window mode: kMaxStaged copy buffers of the largest bucket, allocated once (buffers of a
  // bucket's size malloc'd and freed every step would leave the heap fragmented, the process's
  // resident memory growing past what it holds), and the slot each in-flight bucket uses.
  std::vector<AlignedVector<float>> staged_;
  std::vector<AlignedVector<uint16_t>> staged_h_;
  std::vector<size_t> free_slots_, slot_of_;
  std::vector<size_t> in_flight_;                // window mode: started, not yet retired
  size_t next_ = 0;
  Stats stats_;
};

}  // namespace trn::train
