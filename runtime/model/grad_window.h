// ZeRO-2/3's gradients during a step of one backward (one stage, one micro-batch, one compute
// thread): instead of the whole fp32 gradient buffer, a window that slides over it as the
// backward walks the buffer from front to back, piece by piece (the head, the blocks last to
// first, the embedding), plus the tied embedding's gradient held apart ("pinned": the head
// writes it first and the embedding adds to it last, so it is live through the whole backward).
//
// The window holds buffer offsets [base, hi), at the alignment modulo 64 bytes each element has
// in a whole buffer. Before a piece's backward (grads_for), it zeroes the piece's offsets past
// hi; when they would not fit, it first moves base up to the first bucket not yet handed to the
// reduce-scatter (first_unstarted, which the data-parallel sync advances) and copies what lies
// above to the front. A bucket handed to the reduce-scatter is copied out of the window first
// (copy), so moving the window never waits for communication. Every gradient element is
// computed by the same kernels in the same order as over the whole buffer: only where it sits
// differs, so the sums are the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/model/config.h"
#include "runtime/model/views.h"
#include "runtime/optim/zero.h"

namespace trn::model {

class GradWindow final : public GradSource<float> {
 public:
  // Whether lay's buffer can be held this way (its tied tensor, if any, is the buffer's last).
  static bool fits(const ParamLayout& lay);
  GradWindow(const ParamLayout& lay, const optim::ZeroPlan& plan);

  // A new step: the pinned gradient zeroed, the window empty at base 0.
  void begin();
  const GradView<float>& grads_for(Piece p) override;
  // Buffer offsets [b, e) (final gradients: inside the window or the pinned region) into out,
  // as fp32 or rounded to bf16.
  void copy(size_t b, size_t e, float* out) const;
  void copy_bf16(size_t b, size_t e, uint16_t* out) const;  // the wire's rounding (collectives/dtype.h)
  // The start of the first bucket the sync has not started: the window may drop what lies below.
  void set_first_unstarted(size_t offset) { first_unstarted_ = offset; }

  size_t capacity() const { return cap_; }
  size_t pinned_size() const { return pinned_.size(); }

 private:
  const float* at(size_t off) const;  // a final gradient element's address
  float* window_at(size_t off) { return raw_.data() + lead_ + (off - base_); }

  const ParamLayout& lay_;
  optim::ZeroPlan plan_;
  std::vector<optim::Unit> units_;
  size_t pinned_begin_;                 // the tied tensor's offset (the buffer's size: none)
  AlignedVector<float> pinned_;         // offsets [pinned_begin_, total), 64-byte aligned base
  size_t pinned_lead_ = 0;
  size_t cap_ = 0;                      // elements the window holds
  AlignedVector<float> raw_;            // the window's storage: cap_ + alignment slack
  size_t lead_ = 0;                     // where offset base_ sits in raw_ (base_ % 16)
  size_t base_ = 0, hi_ = 0;            // the window holds [base_, hi_)
  size_t first_unstarted_ = 0;
  GradView<float> view_;
};

}  // namespace trn::model
