// ZeRO-1 arithmetic (no communication): how a rank's flat parameter buffer is partitioned over
// its data-parallel group, and the pieces the global gradient norm is summed from.
//
// Partition. The buffer is cut into buckets; each bucket into dp equal slices of
// q = len / dp elements, slice j belonging to data-parallel rank j; the last rank's slice also
// takes the bucket's len % dp trailing elements (its "tail"). A rank reduce-scatters a bucket as
// soon as backward has finished it (the tail, fewer than dp elements, is all-reduced beside it),
// keeps AdamW's state for its slices only, updates them, and all-gathers the bucket's parameters
// after the step (the tail is broadcast from the last rank). Every element has exactly one owner.
//
// Norm pieces. Without ZeRO the gradient norm is a sum, in a fixed order, of sums of squares of
// fixed pieces: 65536-element chunks of the whole buffer (one process, or dp only), or of each
// tensor (tp or pp, where some tensors are not counted: replicated ones off tp rank 0, the tied
// wte off the first stage). Each piece's sum is one sequential loop in double. Bucket boundaries
// are piece boundaries, so a piece lies in one bucket, and its parts in consecutive slices, i.e.
// on consecutive data-parallel ranks: rank j continues the running sum of a piece that rank j-1
// began (one double per bucket passes down the ranks), which reproduces the unsharded loop bit
// for bit. combine() then adds the piece sums in the unsharded order.
//
// Compact storage. A rank's owned slices, laid one after another in bucket order (skipping
// empty ones), form its compact shard: the layout of AdamW's m and v, and of gradients and
// parameters held compact (Storage). Bucket k's slice starts at owned_offset(k, r) there.
//
// Gather units (ZeRO-3) are whole buckets. The bucket cuts are the same for every ZeRO stage (the
// trainer cuts on both sides of the norm piece over each unit border: unit_stops), so ownership,
// and with it every reduce-scatter sum, is the same at stages 1, 2 and 3 (DESIGN.md "ZeRO").
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "runtime/model/config.h"

namespace trn::optim {

// Elements per piece of the gradient norm's sums of squares (sum_of_squares in adamw.h).
constexpr size_t kSumChunk = size_t(1) << 16;

// How an array over a rank's buffer is held: whole (element i of the buffer at [i]) or compact
// (the rank's compact shard only, at its compact positions).
enum class Storage { kWhole, kCompact };

struct Range {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

struct NormPieces {
  struct Piece {
    size_t begin = 0, end = 0;
    int group = 0;         // the tensor it belongs to (per_tensor), else 0
    bool counted = true;   // false: left out of the norm (a replica counted on another rank)
  };
  bool per_tensor = false;
  std::vector<Piece> pieces;  // in buffer order, covering it exactly

  // Adds the pieces' sums (sums[i] for pieces[i]; uncounted ones ignored) in the order and
  // grouping the unsharded norm uses: one running total over all pieces, or per tensor a running
  // total of its pieces, added to a running total over the tensors.
  double combine(const std::vector<double>& sums) const;
  // Piece boundaries, ascending, 0 and the buffer size included.
  std::vector<size_t> cuts() const;
};

// The pieces of a rank's buffer in a (tp, pp, ep) layout: per tensor when tp, pp or ep is above 1,
// counting replicated tensors on tp rank 0, the tied wte on pipeline rank 0 and, under expert
// parallelism, what is not an expert's on expert rank 0 only (each expert rank counts its own).
NormPieces norm_pieces(const model::ParamLayout& lay, int tp, int pp, int tp_rank, int pp_rank, int ep = 1,
                       int ep_rank = 0);
// Whether norm_pieces cuts per tensor in that layout (every tensor border then a cut), rather than
// in kSumChunk pieces across the whole buffer.
inline bool per_tensor_pieces(int tp, int pp, int ep) { return tp > 1 || pp > 1 || ep > 1; }

class ZeroPlan {
 public:
  struct Bucket {
    size_t begin = 0, end = 0;
    size_t slice = 0;  // q: elements of each rank's slice before the tail
  };

  // n elements over dp ranks. Each bucket ends at the first cut at or past bucket_elems from its
  // start, and never spans a `forced` boundary (a cut too). cuts: ascending, ending with n.
  ZeroPlan(size_t n, int dp, size_t bucket_elems, const std::vector<size_t>& cuts,
           const std::vector<size_t>& forced = {});

  int dp() const { return dp_; }
  size_t size() const { return n_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  // Bucket k's elements past its dp equal slices (fewer than dp), owned by the last rank.
  size_t tail(size_t k) const { return buckets_[k].end - buckets_[k].begin - buckets_[k].slice * size_t(dp_); }
  // Rank r's slice of bucket k (its tail included on the last rank).
  Range slice(size_t k, int r) const;
  // Rank r's non-empty slices in buffer order: the elements whose optimizer state it keeps.
  std::vector<Range> owned(int r) const;
  // The size of rank r's compact shard: its owned elements.
  size_t owned_elements(int r) const { return owned_offset(buckets_.size(), r); }
  // Where bucket k's slice of rank r starts in r's compact shard: the sizes of r's slices of
  // buckets 0..k-1 (k = buckets().size(): the shard's size).
  size_t owned_offset(size_t k, int r) const;
  // The buckets overlapping [begin, end): indices [first, second); empty when begin == end.
  std::pair<size_t, size_t> buckets_over(size_t begin, size_t end) const;
  // Buckets [first, last) as a range of the buffer.
  Range span(size_t first, size_t last) const;

 private:
  size_t n_;
  int dp_;
  std::vector<Bucket> buckets_;
  // Prefix sums over the buckets (K + 1 entries): of the slices q, and of the tails.
  std::vector<size_t> slice_sum_, tail_sum_;
};

// One rank's share of the norm's pieces in one bucket's slice: [begin, end) of piece `piece`.
// first: the piece starts here (its sum starts from 0); otherwise it continues the running sum
// the previous rank passes on. last: the piece ends here (its sum is complete); otherwise the
// running sum passes on to the next rank.
struct Fragment {
  size_t piece = 0, begin = 0, end = 0;
  bool first = true, last = true;
  size_t at = 0;  // where begin sits in the rank's compact shard
};
// Per bucket, rank r's fragments of the counted pieces, in buffer order.
std::vector<std::vector<Fragment>> fragments(const ZeroPlan& plan, const NormPieces& pieces, int r);

// A ZeRO-3 gather unit: the tensors [tensors.begin, tensors.end) one piece of compute uses (a
// block, a chunk's head, a chunk's embedding), held as the whole buckets [first, last) that
// overlap them (span). Units follow the buffer's order; the tensor ranges tile the buffer, every
// tensor in exactly one unit, while neighbours may share the one bucket straddling their border.
struct Unit {
  enum class Kind { kHead, kBlock, kEmbedding };
  Kind kind = Kind::kBlock;
  int layer = -1;      // kBlock: the global layer
  int chunk = 0;       // the chunk of the layout (ParamLayout::chunks()) it belongs to
  Range tensors;       // its own tensors
  size_t first = 0, last = 0;  // its buckets
  Range span;          // the buckets' range of the buffer: covers tensors
  // kHead whose chunk holds the tied LM head: the buckets overlapping it (the head reads it,
  // though the embedding unit owns it); else empty.
  Range tied;
};
// The units of a layout, chunk by chunk in buffer order: the head (when the chunk has one), the
// blocks last to first, then the embedding's tensors (when the chunk adds any).
std::vector<Unit> units(const model::ParamLayout& lay, const ZeroPlan& plan);

// The bucket stops (ZeroPlan's `forced`) at the units' borders: at each border (a chunk's start,
// the head's end, each block's end) the last cut at or before it and the first at or past it, so
// the one norm piece straddling a border is a bucket of its own. A unit's span then reaches at
// most one piece (kSumChunk elements) past each end of its tensors, whatever the bucket size:
// ZeRO-3 gathers whole buckets, and a bucket spanning a border would be gathered (and held) for
// the units on both sides. cuts: the norm pieces' (NormPieces::cuts()), ascending from 0.
std::vector<size_t> unit_stops(const model::ParamLayout& lay, const std::vector<size_t>& cuts);

}  // namespace trn::optim
