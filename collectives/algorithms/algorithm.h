// The collective algorithms (DESIGN.md layer 4), one file each. They speak only to a Context:
// point-to-point messages between the ranks of one communicator, tagged by (operation, step),
// and a reusable scratch area. All run synchronously on the communicator's thread; all are
// deterministic: for a given world size, algorithm and chunk size the reduction order is fixed,
// and every rank ends with bit-identical results.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/core/aligned.h"
#include "collectives/core/deadline.h"
#include "collectives/cost_model.h"
#include "collectives/dtype.h"
#include "collectives/fp8.h"
#include "collectives/p2p.h"

namespace trn::algo {

// Grows on demand and is kept between operations, so steady-state collectives do not allocate.
class Scratch {
 public:
  static constexpr int kSlots = 3;
  // Slot 0 belongs to the algorithm's inner loop; callers that wrap an algorithm use 1 and 2.
  char* get(size_t bytes, int slot) {
    auto& b = bufs_[slot];
    if (b.size() < bytes) b.resize(bytes);
    return b.data();
  }

 private:
  AlignedVector<char> bufs_[kSlots];  // 64-byte aligned, as messages from them cross the wire
};

class Context {
 public:
  Context(PointToPoint& p2p, const std::vector<int>& world_ranks, int rank, uint32_t comm_id,
          uint64_t seq, Deadline deadline, size_t chunk_bytes, Scratch& scratch)
      : p2p_(p2p), world_ranks_ref_(&world_ranks), rank_(rank), comm_id_(comm_id), seq_(seq),
        deadline_(deadline), chunk_bytes_(chunk_bytes), scratch_(scratch) {}

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks().size()); }
  Deadline deadline() const { return deadline_; }
  // Preferred pipeline chunk in bytes (algorithms split larger pieces into chunks this size).
  size_t chunk_bytes() const { return chunk_bytes_; }
  char* scratch(size_t bytes, int slot = 0) { return scratch_.get(bytes, slot); }
  // A copy with another pipeline chunk (all ranks must pick the same).
  Context with_chunk_bytes(size_t bytes) const {
    Context c = *this;
    c.chunk_bytes_ = bytes;
    return c;
  }
  // A copy whose steps start at base, for running several algorithms within one operation.
  Context with_step_base(uint64_t base) const {
    Context c = *this;
    c.step_base_ = base;
    return c;
  }

  // A context over some of this communicator's ranks, for algorithms made of phases over
  // subgroups: world_ranks are the members' transport ranks in the subgroup's order (it must
  // outlive the copy), rank is this rank's place among them. The copy shares this operation's
  // tags, so two phases whose messages may meet between the same two ranks need different step
  // bases.
  Context subgroup(const std::vector<int>& world_ranks, int rank) const {
    Context c = *this;
    c.world_ranks_ref_ = &world_ranks;
    c.rank_ = rank;
    return c;
  }
  // The transport rank of member i.
  int world_rank(int i) const { return ranks()[i]; }

  // Messages to/from a rank of this communicator; step distinguishes the messages of one
  // operation between the same two ranks (collectives/tag.h).
  RequestPtr isend(int peer, uint64_t step, const void* buf, size_t len);
  RequestPtr irecv(int peer, uint64_t step, void* buf, size_t len);
  // Waits with this operation's deadline; null requests are ignored.
  void wait(const RequestPtr& r);
  void wait_all(std::vector<RequestPtr>& rs);

 private:
  const std::vector<int>& ranks() const { return *world_ranks_ref_; }
  PointToPoint& p2p_;
  const std::vector<int>* world_ranks_ref_;
  int rank_;
  uint32_t comm_id_;
  uint64_t seq_;
  Deadline deadline_;
  size_t chunk_bytes_;
  Scratch& scratch_;
  uint64_t step_base_ = 0;
};

// [start, end) of part i when count elements are split into parts as evenly as possible.
inline size_t part_begin(size_t count, int parts, int i) {
  return static_cast<size_t>((static_cast<unsigned __int128>(count) * i) / parts);
}

// All-reduce of count elements of buf in place (kAvg reduces as sum; the caller divides).
// The ring also works out of place (in != out) without copying the input first.
void allreduce_ring(Context& c, const void* in, void* out, size_t count, DataType t, ReduceOp op);
void allreduce_tree(Context& c, void* buf, size_t count, DataType t, ReduceOp op);
// rhd exchanges whole vectors by recursive doubling up to doubling_max_bytes (the communicator
// passes the cost model's crossover for its link, rhd_doubling_max_bytes), halves them above it.
inline constexpr size_t kRhdDoublingMaxBytes = 32 * 1024;
void allreduce_rhd(Context& c, void* buf, size_t count, DataType t, ReduceOp op,
                   size_t doubling_max_bytes = kRhdDoublingMaxBytes);

// Hierarchical all-reduce (allreduce_hier.cc). host_of[i] names the host of member i; every host
// must hold the same number of members. in == out is in place; kAvg reduces as sum.
struct HierPlan {
  size_t intra_chunk = 0;  // pipeline chunk of the phases within a host
  size_t inter_chunk = 0;  // ... and of the ring across hosts
  Algo cross = Algo::kRing;  // the inter-host phase: ring, tree or rhd
  size_t cross_doubling_max = kRhdDoublingMaxBytes;  // rhd's doubling bound in that phase
};
void allreduce_hier(Context& c, const std::vector<int>& host_of, const void* in, void* out, size_t count,
                    DataType t, ReduceOp op, const HierPlan& plan);

// The ring core shared by all-reduce, reduce-scatter and all-gather: buf holds size() segments,
// segment i at bytes [seg[i], seg[i+1]). Reduce-scatter leaves segment (rank + 1 + offset) mod
// size fully reduced; all-gather then spreads it (or, alone, spreads segment rank). in, when not
// null, holds this rank's contribution laid out like buf (which is then only written); null
// means buf holds it.
void ring(Context& c, const char* in, char* buf, const std::vector<size_t>& seg, DataType t,
          ReduceOp op, bool reduce_scatter, bool all_gather, int offset);

// f32 all-reduce and reduce-scatter with e4m3 on the wire (allreduce_e4m3.cc); avg divides the
// sum by size(). All-reduce: in == out is in place. Reduce-scatter: in holds size() blocks of
// count, out gets block rank() (out may be in + rank() * count). residual: null, or error
// feedback laid out like in (e4m3_encode_feedback).
void allreduce_e4m3(Context& c, const float* in, float* out, size_t count, bool avg, float* residual,
                    Fp8Format fmt);
void reduce_scatter_e4m3(Context& c, const float* in, float* out, size_t count, bool avg, float* residual,
                         Fp8Format fmt);
// Reduce-scatter: in holds size() blocks of count elements; out gets block rank(), reduced.
void reduce_scatter_ring(Context& c, const void* in, void* out, size_t count, DataType t, ReduceOp op);
// All-gather: buf holds size() blocks of block_bytes; block rank() is this rank's contribution.
void all_gather_ring(Context& c, void* buf, size_t block_bytes);
// Broadcast of bytes from root: a binomial tree for small messages, a pipelined chain otherwise.
void broadcast(Context& c, void* buf, size_t bytes, int root);
// Reduce to root along a pipelined chain; buf is this rank's contribution and, at root, the
// result (other ranks' buf is left unchanged).
void reduce_chain(Context& c, void* buf, size_t count, DataType t, ReduceOp op, int root);
void barrier_dissemination(Context& c);
// in and out hold size() blocks of block_bytes; block j of in goes to rank j.
void all_to_all_pairwise(Context& c, const void* in, void* out, size_t block_bytes);
// Variable-size all-to-all (all_to_all_v.cc), in bytes: rank j gets send_bytes[j] from
// in + send_off[j]; recv_bytes[i] from rank i land at out + recv_off[i]. in must not overlap
// out's receive regions (the communicator copies it aside when it does). pairwise: n - 1 exchange
// steps; else direct, every message posted at once (cost_model.h, A2aAlgo).
struct AllToAllV {
  const char* in = nullptr;
  char* out = nullptr;
  std::vector<size_t> send_bytes, send_off, recv_bytes, recv_off;  // size() entries each
  // The pipeline chunk of the messages with each rank (both ranks of a pair must pick the same
  // for it); empty: the context's chunk for all.
  std::vector<size_t> chunk;
};
void all_to_all_v(Context& c, const AllToAllV& x, bool pairwise);

}  // namespace trn::algo
