// ZeRO-3's weights (--zero 3): each data-parallel rank keeps only its compact shard of the fp32
// master (optim::ZeroPlan's owned slices, one after another), and the weights a piece of compute
// reads are all-gathered from every rank's shard just before it runs and freed after.
//
// Gather units (optim::units): a block, a chunk's head (with the buckets over the tied wte it
// multiplies by) and a chunk's embedding, each held as the whole buckets overlapping its tensors,
// gathered bucket by bucket exactly as ZeRO-1 gathers its updated parameters (all_gather of the
// slices, broadcast of the tail from the last rank) into storage that puts every element at the
// address, modulo 64 bytes, it has in a whole buffer (SegmentStorage). A piece computes on the
// same values at the same alignment as over the whole buffer, so every result is bit-identical
// to ZeRO-1's.
//
// Under Precision::kBf16 the wire carries bf16 (FSDP's param_dtype): each rank rounds its own
// slices of the matmul tensors to bf16, elementwise as Bf16Weights rounds the whole buffer, and
// the compute reads the arrived bf16 form. The elements a piece reads in fp32 (norms, biases, and
// the embedding tables a lookup reads) travel whole, as their high and low halves, so nothing the
// compute reads changes: the unit's gather is one all_gather of a packed message per rank (its
// slices' high halves, then the low halves of the fp32 elements among them), unpacked on arrival.
// The embedding unit, which the lookup reads in fp32 only, keeps the fp32 wire and builds no bf16
// form; so does a range that is mostly fp32 elements.
//
// Order and prefetch. Before each pass (a forward, or a forward and backward) the model gives the
// order its pieces will be asked for (order_for). Gathers are issued on their own communicator
// (a split of the data-parallel group, so they never queue behind the backward's gradient
// reduce-scatters) strictly in that order, through `prefetch` units past the furthest one a
// compute thread has asked for: every rank issues the same gathers in the same order whichever of
// its compute threads gets there first. Two uses of one unit in a row (the head's forward and backward), or with one unit
// between (the last block's forward and backward, around the head), share one gather. A gather
// is freed once all `users` compute threads released its last use.
//
// Ranges (a pipeline stage's chunks): issue_range / wait / free gather a range of the buffer,
// rounded out to whole buckets, on the same wire as a unit's (its embedding tables carried in
// fp32), when the caller says so (the stage's UNSHARD / RESHARD actions, pipeline/schedule.h); the caller issues them in
// one order on every data-parallel rank.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/kernels/bf16.h"
#include "runtime/model/views.h"
#include "runtime/optim/zero.h"
#include "runtime/util/thread_pool.h"

namespace trn::model {

class ShardedWeights final : public WeightSource<float> {
 public:
  // plan: the data-parallel partition of lay's buffer (comm's members, comm->rank() this rank);
  // users: the compute threads that each acquire every piece of a pass.
  ShardedWeights(const ParamLayout& lay, const optim::ZeroPlan& plan, std::shared_ptr<Communicator> comm, int users,
                 int prefetch);
  ~ShardedWeights() override;

  // The compact fp32 master: this rank's owned elements in owned order (Storage::kCompact).
  float* master() { return master_.data(); }
  const float* master() const { return master_.data(); }
  size_t master_size() const { return master_.size(); }
  const optim::ZeroPlan& plan() const { return plan_; }
  int rank() const { return comm_->rank(); }

  // The pieces a one-stage model asks for in a forward (and then a backward): the embedding,
  // the blocks first to last and the head; the head, the blocks last to first.
  std::vector<Piece> order_for(bool backward) const;
  // Starts a pass over `order` (called outside the compute threads, with nothing held): the
  // first `prefetch` + 1 gathers are issued at once.
  void begin(const std::vector<Piece>& order);
  // Ends the pass: every gather was released (else an internal error), none is in flight.
  void end();
  // Drops the pass after a failure: waits out the gathers in flight (they fail with the
  // transport) and frees every buffer.
  void abandon() noexcept;

  const WeightView<float>& acquire(Piece p) override;
  void release(Piece p) noexcept override;

  // A range's gather: issue_range(begin, end) posts the gathers of the whole buckets over [begin,
  // end) of the buffer and returns at once; wait(h) blocks until they arrived (counted as exposed)
  // and gives the range's view (fp32, and under bf16 the bf16 form of its matmul tensors), valid
  // until free(h), which frees the buffers. Called from one thread; abandon() also drops ranges.
  using RangeHandle = size_t;
  RangeHandle issue_range(size_t begin, size_t end);
  const WeightView<float>& wait(RangeHandle h);
  void free(RangeHandle h) noexcept;
  // How many units (or a pipeline's compute actions) ahead gathers are issued.
  int prefetch() const { return prefetch_; }

  // The whole buffer gathered from every rank's shard into whole (lay.total() floats): collective
  // over the data-parallel group, for --save, checkpoints and the end-of-run checks (not counted
  // in stats()).
  void gather_whole(float* whole);
  // The compact shard of a whole buffer: this rank's owned elements of whole.
  void keep_owned(const float* whole);

  // Gathers and bytes gathered over the run, for the log.
  struct Stats {
    int64_t gathers = 0;
    double bytes = 0;
    double exposed_s = 0;  // time compute threads waited for a gather to arrive
    double busy_s = 0;     // time the gathers ran (first start to last end of each unit's)
    // The share of the gathers' time that compute did not wait for (1 with no gathers).
    double hidden() const { return busy_s > 0 ? std::clamp(1.0 - exposed_s / busy_s, 0.0, 1.0) : 1.0; }
  };
  const Stats& stats() const { return stats_; }
  // Zeroes the times (not the counts): the trainer calls it after its first step, whose gathers
  // also wait for the gather communicator's start-up and for the slowest rank to arrive.
  void restart_timing() {
    std::lock_guard lock(mu_);
    stats_.exposed_s = stats_.busy_s = 0;
  }

 private:
  struct Part;
  struct Gather;
  // A position of the pass's order: the gather it uses and the acquires it still expects.
  struct Slot {
    size_t gather = 0;
    int uses_left = 0;
  };
  // A part's gather plan: range (whole buckets); tables: the embedding tables in it are read in
  // fp32 (the lookup); form: the bf16 form of its matmul tensors is built.
  Part plan_part(optim::Range range, bool tables, bool form) const;
  void issue_through(size_t index);  // under mu_: slots_[issued_, index] issued
  void issue(Gather& g);             // under mu_, g.parts planned
  void post(Part& p, std::vector<WorkPtr>& works);   // under mu_
  void finish(Part& p, WeightView<float>& view) const;  // on arrival: unpack, round, add to view
  void arrive(Gather& g);            // under g's once: waits, finishes the parts, builds the view
  const WeightView<float>& await(Gather& g);  // arrive once, the wait counted as exposed
  // Waits for every operation to end, ignoring failures (they no longer touch their buffers).
  static void settle(std::vector<WorkPtr>& works) noexcept;
  int unit_of(Piece p) const;
  // Storage for gathered units (fp32 units, and the bf16 wire's receive buffers), kept for the
  // next piece instead of freed (under mu_): buffers of a block's size allocated and freed every
  // pass leave the heap fragmented and the process's resident memory growing past what it holds.
  // At most kPooled of each are kept, and none larger than `limit` elements (about a block's): a
  // freed embedding or tied head would otherwise stay resident beside the units in use (the
  // allocator maps buffers that large on their own and unmaps them when freed).
  static constexpr size_t kPooled = 2;
  template <typename T>
  static AlignedVector<T> take(std::vector<AlignedVector<T>>& pool, size_t n);
  template <typename T>
  static void give(std::vector<AlignedVector<T>>& pool, AlignedVector<T>&& v, size_t limit);
  void recycle(Gather& g);  // under mu_

  const ParamLayout& lay_;
  optim::ZeroPlan plan_;
  std::shared_ptr<Communicator> comm_;
  int users_, prefetch_;
  AlignedVector<float> master_;
  std::vector<optim::Unit> units_;
  std::mutex mu_;
  std::vector<AlignedVector<float>> pool_f_;  // the fp32 units' storage
  std::vector<AlignedVector<kernels::bf16>> pool_w_;  // the bf16 wire's receive buffers
  size_t pooled_f_ = 0, pooled_w_ = 0;  // the pools' limits: a block unit's fp32 storage, its wire
  // The buffer's elements a piece reads in fp32 under bf16, as sorted disjoint ranges: the
  // non-matmul tensors, and apart from them the embedding units' tensors (the lookup tables).
  std::vector<optim::Range> f32_tensors_, tables_;
  std::vector<std::unique_ptr<Gather>> gathers_;  // the pass's, in first-use order
  // The pass's order. A unit used twice in a row, or twice with one other unit between (the last
  // block around the head's turn), is one gather: it stays while the unit between computes.
  std::vector<Slot> slots_;
  size_t issued_ = 0;  // slots_[0, issued_) are issued
  // Which gather each compute thread holds (a thread holds one piece at a time).
  std::vector<std::pair<std::thread::id, size_t>> held_;
  std::vector<std::unique_ptr<Gather>> ranges_;  // issue_range's, by handle (null: freed)
  Stats stats_;
};

}  // namespace trn::model
