#include "runtime/optim/zero.h"

#include <algorithm>
#include <tuple>

#include "collectives/core/error.h"

namespace trn::optim {

double NormPieces::combine(const std::vector<double>& sums) const {
  TRN_CHECK(sums.size() == pieces.size());
  if (!per_tensor) {
    double total = 0.0;
    for (size_t i = 0; i < pieces.size(); ++i)
      if (pieces[i].counted) total += sums[i];
    return total;
  }
  double local = 0.0;
  for (size_t i = 0; i < pieces.size();) {
    const int g = pieces[i].group;
    double t = 0.0;
    const bool counted = pieces[i].counted;
    for (; i < pieces.size() && pieces[i].group == g; ++i) t += sums[i];
    if (counted) local += t;
  }
  return local;
}

std::vector<size_t> NormPieces::cuts() const {
  std::vector<size_t> out{0};
  for (const Piece& p : pieces) out.push_back(p.end);
  return out;
}

NormPieces norm_pieces(const model::ParamLayout& lay, int tp, int pp, int tp_rank, int pp_rank, int ep, int ep_rank) {
  NormPieces out;
  out.per_tensor = per_tensor_pieces(tp, pp, ep);
  auto chunk = [&](size_t begin, size_t end, int group, bool counted) {
    for (size_t b = begin; b < end; b += kSumChunk)
      out.pieces.push_back({b, std::min(end, b + kSumChunk), group, counted});
  };
  if (!out.per_tensor) {
    chunk(0, lay.total(), 0, true);
    return out;
  }
  int g = 0;
  for (const model::TensorSpec& t : lay.tensors()) {
    const bool counted =
        !(t.replicated() && tp_rank != 0) && !(t.tied && pp_rank != 0) && !(!t.expert && ep_rank != 0);
    chunk(t.offset, t.offset + t.numel, g++, counted);
  }
  return out;
}

ZeroPlan::ZeroPlan(size_t n, int dp, size_t bucket_elems, const std::vector<size_t>& cuts,
                   const std::vector<size_t>& forced)
    : n_(n), dp_(dp) {
  TRN_CHECK(dp >= 1 && !cuts.empty() && cuts.back() == n);
  std::vector<size_t> stops = forced;
  stops.push_back(n);
  std::sort(stops.begin(), stops.end());
  for (size_t b = 0; b < n;) {
    const size_t target = b + std::max<size_t>(bucket_elems, 1);
    const size_t stop = *std::upper_bound(stops.begin(), stops.end(), b);  // the next forced boundary
    size_t e = *std::lower_bound(cuts.begin(), cuts.end(), std::min(target, stop));
    e = std::min(e, stop);
    TRN_CHECK(e > b);
    Bucket k;
    k.begin = b;
    k.end = e;
    k.slice = (e - b) / size_t(dp);
    buckets_.push_back(k);
    b = e;
  }
  slice_sum_.assign(1, 0);
  tail_sum_.assign(1, 0);
  for (size_t k = 0; k < buckets_.size(); ++k) {
    slice_sum_.push_back(slice_sum_.back() + buckets_[k].slice);
    tail_sum_.push_back(tail_sum_.back() + tail(k));
  }
}

size_t ZeroPlan::owned_offset(size_t k, int r) const {
  TRN_CHECK(k <= buckets_.size() && r >= 0 && r < dp_);
  // Every rank's slice of a bucket has q elements; the last rank's has the tail too.
  return slice_sum_[k] + (r == dp_ - 1 ? tail_sum_[k] : 0);
}

std::pair<size_t, size_t> ZeroPlan::buckets_over(size_t begin, size_t end) const {
  TRN_CHECK(begin <= end && end <= n_);
  if (begin == end) return {0, 0};
  const auto after = [](size_t x, const Bucket& b) { return x < b.end; };
  const size_t first = size_t(std::upper_bound(buckets_.begin(), buckets_.end(), begin, after) - buckets_.begin());
  const size_t last = size_t(std::upper_bound(buckets_.begin(), buckets_.end(), end - 1, after) - buckets_.begin()) + 1;
  return {first, last};
}

Range ZeroPlan::span(size_t first, size_t last) const {
  TRN_CHECK(first <= last && last <= buckets_.size());
  if (first == last) return {};
  return {buckets_[first].begin, buckets_[last - 1].end};
}

Range ZeroPlan::slice(size_t k, int r) const {
  const Bucket& b = buckets_.at(k);
  const size_t lo = b.begin + size_t(r) * b.slice;
  return {lo, r == dp_ - 1 ? b.end : lo + b.slice};
}

std::vector<Range> ZeroPlan::owned(int r) const {
  std::vector<Range> out;
  for (size_t k = 0; k < buckets_.size(); ++k) {
    const Range s = slice(k, r);
    if (s.size() == 0) continue;
    if (!out.empty() && out.back().end == s.begin) out.back().end = s.end;  // dp 1: one range
    else out.push_back(s);
  }
  return out;
}

std::vector<std::vector<Fragment>> fragments(const ZeroPlan& plan, const NormPieces& np, int r) {
  std::vector<std::vector<Fragment>> out(plan.buckets().size());
  const auto& ps = np.pieces;
  for (size_t k = 0; k < out.size(); ++k) {
    const Range s = plan.slice(k, r);
    if (s.size() == 0) continue;
    // The first piece reaching into the slice.
    size_t i = size_t(std::upper_bound(ps.begin(), ps.end(), s.begin,
                                       [](size_t x, const NormPieces::Piece& p) { return x < p.end; }) -
                      ps.begin());
    for (; i < ps.size() && ps[i].begin < s.end; ++i) {
      if (!ps[i].counted) continue;
      Fragment f;
      f.piece = i;
      f.begin = std::max(ps[i].begin, s.begin);
      f.end = std::min(ps[i].end, s.end);
      f.first = ps[i].begin >= s.begin;
      f.last = ps[i].end <= s.end;
      f.at = plan.owned_offset(k, r) + (f.begin - s.begin);
      out[k].push_back(f);
    }
  }
  return out;
}

std::vector<Unit> units(const model::ParamLayout& lay, const ZeroPlan& plan) {
  TRN_CHECK(plan.size() == lay.total());
  const model::TensorSpec* tied = lay.tied();
  Range tied_span;
  if (tied) {
    const auto [first, last] = plan.buckets_over(tied->offset, tied->offset + tied->numel);
    tied_span = plan.span(first, last);
  }
  std::vector<Unit> out;
  auto add = [&](Unit::Kind kind, int chunk, int layer, size_t begin, size_t end) {
    if (begin == end) return;
    Unit u;
    u.kind = kind;
    u.chunk = chunk;
    u.layer = layer;
    u.tensors = {begin, end};
    std::tie(u.first, u.last) = plan.buckets_over(begin, end);
    u.span = plan.span(u.first, u.last);
    out.push_back(u);
  };
  // Chunks sit in the buffer last to first (ParamLayout), so walk them in that order.
  const auto& chunks = lay.chunks();
  for (int c = int(chunks.size()) - 1; c >= 0; --c) {
    const model::Chunk& k = chunks[size_t(c)];
    const auto [begin, end] = lay.chunk_range(c);
    size_t at = begin;
    if (k.head) {
      add(Unit::Kind::kHead, c, -1, begin, lay.head_end);
      // The head multiplies by the tied embedding, which this chunk holds.
      if (tied && tied->offset >= begin && tied->offset < end) out.back().tied = tied_span;
      at = lay.head_end;
    }
    for (int l = k.end_layer - 1; l >= k.first_layer; --l) {
      TRN_CHECK(lay.blocks[size_t(l)].begin == at);
      add(Unit::Kind::kBlock, c, l, at, lay.blocks[size_t(l)].end);
      at = lay.blocks[size_t(l)].end;
    }
    add(Unit::Kind::kEmbedding, c, -1, at, end);
  }
  return out;
}

std::vector<size_t> unit_stops(const model::ParamLayout& lay, const std::vector<size_t>& cuts) {
  TRN_CHECK(!cuts.empty() && cuts.front() == 0 && cuts.back() == lay.total());
  std::vector<size_t> out;
  auto border = [&](size_t at) {
    const auto up = std::lower_bound(cuts.begin(), cuts.end(), at);
    out.push_back(*up);
    if (*up != at) out.push_back(*(up - 1));  // cuts.front() == 0 <= at: up is past the first
  };
  for (int c = 0; c < int(lay.chunks().size()); ++c) {
    const model::Chunk& k = lay.chunks()[size_t(c)];
    border(lay.chunk_range(c).first);
    if (k.head) border(lay.head_end);
    for (int l = k.first_layer; l < k.end_layer; ++l) border(lay.blocks[size_t(l)].end);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace trn::optim
