#include "runtime/model/grad_window.h"

#include <algorithm>
#include <cstring>

#include "collectives/core/error.h"
#include "collectives/dtype.h"

namespace trn::model {
namespace {

constexpr size_t kLine = kBufferAlign / sizeof(float);  // floats per 64 bytes

}  // namespace

bool GradWindow::fits(const ParamLayout& lay) {
  const TensorSpec* tied = lay.tied();
  return lay.chunks().size() == 1 && (!tied || tied->offset + tied->numel == lay.total());
}

GradWindow::GradWindow(const ParamLayout& lay, const optim::ZeroPlan& plan)
    : lay_(lay), plan_(plan), units_(optim::units(lay, plan)) {
  TRN_CHECK(fits(lay));
  const TensorSpec* tied = lay.tied();
  pinned_begin_ = tied ? tied->offset : lay.total();
  pinned_lead_ = pinned_begin_ % kLine;
  pinned_.assign(pinned_lead_ + (lay.total() - pinned_begin_), 0.0f);
  // The most a piece can need: its own offsets below the pinned region, plus the partial bucket
  // below its start that the sync has not started yet.
  size_t biggest = 0, bucket = 0;
  for (const optim::Unit& u : units_)
    biggest = std::max(biggest, std::min(u.tensors.end, pinned_begin_) - std::min(u.tensors.begin, pinned_begin_));
  for (const optim::ZeroPlan::Bucket& b : plan_.buckets()) bucket = std::max(bucket, b.end - b.begin);
  cap_ = std::min(pinned_begin_, biggest + bucket);
  raw_.assign(cap_ + kLine, 0.0f);
}

void GradWindow::begin() {
  std::fill(pinned_.begin(), pinned_.end(), 0.0f);
  base_ = hi_ = first_unstarted_ = 0;
  lead_ = 0;
}

const GradView<float>& GradWindow::grads_for(Piece p) {
  const optim::Unit* unit = nullptr;
  for (const optim::Unit& u : units_) {
    const bool match = u.chunk == p.chunk && ((p.kind == PieceKind::kBlock && u.kind == optim::Unit::Kind::kBlock &&
                                               u.layer == p.layer) ||
                                              (p.kind == PieceKind::kHead && u.kind == optim::Unit::Kind::kHead) ||
                                              (p.kind == PieceKind::kEmbedding &&
                                               u.kind == optim::Unit::Kind::kEmbedding));
    if (match) unit = &u;
  }
  if (!unit) throw internal_error("no gradient unit for piece {} (layer {})", int(p.kind), p.layer);
  const size_t need = std::min(unit->tensors.end, pinned_begin_);
  if (need > base_ + cap_) {
    // Slide: keep from the first bucket not yet started (its gradients are still to be
    // reported, or partly written), copied to the front at its whole-buffer alignment.
    const size_t from = std::max(base_, std::min(first_unstarted_, hi_));
    const size_t keep = hi_ - from, lead = from % kLine;
    if (need - from > cap_)
      throw internal_error("the gradient window of {} elements cannot hold offsets [{}, {})", cap_, from, need);
    std::memmove(raw_.data() + lead, raw_.data() + lead_ + (from - base_), sizeof(float) * keep);
    base_ = from;
    lead_ = lead;
  }
  if (need > hi_) {
    std::fill(window_at(std::max(hi_, base_)), window_at(need), 0.0f);
    hi_ = need;
  }
  view_ = GradView<float>();
  view_.add(base_, hi_, raw_.data() + lead_);
  if (pinned_begin_ < lay_.total()) view_.add(pinned_begin_, lay_.total(), pinned_.data() + pinned_lead_);
  return view_;
}

const float* GradWindow::at(size_t off) const {
  if (off >= pinned_begin_) return pinned_.data() + pinned_lead_ + (off - pinned_begin_);
  TRN_CHECK(off >= base_ && off < hi_);
  return raw_.data() + lead_ + (off - base_);
}

void GradWindow::copy(size_t b, size_t e, float* out) const {
  // At most two runs: below the pinned region (in the window) and inside it.
  const size_t split = std::clamp(pinned_begin_, b, e);
  TRN_CHECK(split == b || split <= hi_);
  if (split > b) std::memcpy(out, at(b), sizeof(float) * (split - b));
  if (e > split) std::memcpy(out + (split - b), at(split), sizeof(float) * (e - split));
}

void GradWindow::copy_bf16(size_t b, size_t e, uint16_t* out) const {
  const size_t split = std::clamp(pinned_begin_, b, e);
  TRN_CHECK(split == b || split <= hi_);
  if (split > b) {
    const float* in = at(b);
    for (size_t i = 0; i < split - b; ++i) out[i] = f32_to_bf16(in[i]);
  }
  if (e > split) {
    const float* in = at(split);
    for (size_t i = 0; i < e - split; ++i) out[split - b + i] = f32_to_bf16(in[i]);
  }
}

}  // namespace trn::model
