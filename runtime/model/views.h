// How a model's bodies reach its weights and gradients: views, which map an absolute offset of
// the rank's parameter buffer (what ParamLayout gives, e.g. Gpt2Offsets::attn_w) to a pointer.
//
// A view is a few segments, each [begin, end) of the buffer's offsets held contiguously at ptr
// in one form: the master (kF32: T, fp32 on a float stage, double on the reference stage), bf16
// (kBf16), or bf16 values widened to fp32 (kWidened: the emulated bf16 path's form). The master
// lookups (f32) search the kF32 segments, the bf16 lookups the other two. Today every view is a
// whole buffer, one master segment {0, total, params} (and under Precision::kBf16 one bf16
// segment over the same offsets, the Bf16Weights copy), so the pointers are exactly those of
// `params + off`. Sharded parameters (ZeRO-3) give the bodies views of the gathered pieces
// instead, with nothing else in the bodies changed.
//
// A pointer is always computed inside its segment, `ptr + (off - begin)`, never by rebasing
// (`ptr - begin` is undefined behaviour outside the allocation). An offset outside every
// segment of its form is a trn bug: an assertion in debug builds, a null pointer in release.
#pragma once

#include <cassert>
#include <cstddef>
#include <utility>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/kernels/bf16.h"

namespace trn::model {

enum class Form : unsigned char { kF32, kBf16, kWidened };

// A piece of a stage's compute that reads one set of weights: a chunk's embedding, a block (by
// its global layer), a chunk's head. Sharded weights are gathered piece by piece.
enum class PieceKind : unsigned char { kEmbedding, kBlock, kHead };
struct Piece {
  PieceKind kind = PieceKind::kBlock;
  int chunk = 0;   // the chunk of the layout (ParamLayout::chunks())
  int layer = -1;  // kBlock: the global layer
  bool operator==(const Piece&) const = default;
};

template <typename T>
class WeightView;

// Where a stage gets the weights of each piece when the rank does not hold them whole (ZeRO-3,
// runtime/model/sharded.h): acquire blocks until the piece's weights are here and returns their
// view, valid until the matching release. Callable from every compute thread at once; each
// thread acquires and releases the pieces of one pass in the stage's order.
template <typename T>
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const WeightView<T>& acquire(Piece p) = 0;
  virtual void release(Piece p) noexcept = 0;
};

struct Segment {
  size_t begin = 0, end = 0;  // buffer offsets [begin, end)
  const void* ptr = nullptr;  // the element at begin
  Form form = Form::kF32;
  bool holds(size_t off, size_t n) const { return off >= begin && off <= end && n <= end - off; }
};

// The weights a forward or backward reads.
template <typename T>
class WeightView {
 public:
  WeightView() = default;
  // The whole buffer: params holds offsets [0, total) in the master form.
  static WeightView whole(const T* params, size_t total) {
    WeightView v;
    v.add_f32(0, total, params);
    return v;
  }
  // Offsets [begin, end) at p (the element at begin).
  WeightView& add_f32(size_t begin, size_t end, const T* p) { return add({begin, end, p, Form::kF32}); }
  // The bf16 form of offsets [begin, end): a bf16 array, or bf16 values widened to fp32 (the
  // widened one when src has both).
  WeightView& add_bf16(size_t begin, size_t end, kernels::Bf16Src src) {
    if (src.f) return add({begin, end, src.f, Form::kWidened});
    return add({begin, end, src.h, Form::kBf16});
  }

  // The master form of elements [off, off + n).
  const T* f32(size_t off, size_t n = 1) const {
    for (const Segment& s : segs_)
      if (s.form == Form::kF32 && s.holds(off, n)) return static_cast<const T*>(s.ptr) + (off - s.begin);
    assert(!"a weight offset outside the view");
    return nullptr;
  }
  // The bf16 form of elements [off, off + n), as the bf16 kernels take it.
  kernels::Bf16Src bf16(size_t off, size_t n = 1) const {
    for (const Segment& s : segs_) {
      if (s.form == Form::kF32 || !s.holds(off, n)) continue;
      if (s.form == Form::kWidened)
        return kernels::Bf16Src::widened(static_cast<const float*>(s.ptr) + (off - s.begin));
      return static_cast<const kernels::bf16*>(s.ptr) + (off - s.begin);
    }
    assert(!"a bf16 weight offset outside the view");
    return {};
  }
  bool has_bf16() const {
    for (const Segment& s : segs_)
      if (s.form != Form::kF32) return true;
    return false;
  }
  const std::vector<Segment>& segments() const { return segs_; }

  // A view with no segments of its own whose pieces come from source (which outlives it):
  // stages ask it for each piece's view (FamilyStage), so only the pieces in use are held.
  static WeightView sourced(WeightSource<T>* source) {
    WeightView v;
    v.source_ = source;
    return v;
  }
  WeightSource<T>* source() const { return source_; }

 private:
  WeightView& add(Segment s) {
    assert(s.begin <= s.end && (s.ptr || s.begin == s.end));
    segs_.push_back(s);
    return *this;
  }
  std::vector<Segment> segs_;
  WeightSource<T>* source_ = nullptr;
};

// The weights of one piece for as long as it lives: the view itself, or what its source holds
// for the piece (acquired here, released by the destructor, also when the piece's compute
// throws).
template <typename T>
class HeldPiece {
 public:
  HeldPiece(const WeightView<T>& w, Piece p) : src_(w.source()), p_(p), view_(src_ ? &src_->acquire(p) : &w) {}
  ~HeldPiece() {
    if (src_) src_->release(p_);
  }
  HeldPiece(const HeldPiece&) = delete;
  HeldPiece& operator=(const HeldPiece&) = delete;
  const WeightView<T>& view() const { return *view_; }

 private:
  WeightSource<T>* src_;
  Piece p_;
  const WeightView<T>* view_;
};

template <typename T>
class GradView;

// Where a backward gets the gradients of each piece when the rank does not hold the whole
// buffer for the step (ZeRO-2/3's gradient window, runtime/model/grad_window.h): grads_for is
// called on the compute thread before the piece's backward, in backward order, and the view
// stays valid until the next call.
template <typename T>
class GradSource {
 public:
  virtual ~GradSource() = default;
  virtual const GradView<T>& grads_for(Piece p) = 0;
};

// The gradients a backward adds into: segments of the master form, writable.
template <typename T>
class GradView {
 public:
  GradView() = default;
  // A view whose pieces' gradients come from source (which outlives it).
  static GradView sourced(GradSource<T>* source) {
    GradView v;
    v.source_ = source;
    return v;
  }
  GradSource<T>* source() const { return source_; }
  // The view piece p adds into: this one, or its source's for p.
  const GradView& piece(Piece p) const { return source_ ? source_->grads_for(p) : *this; }
  static GradView whole(T* grads, size_t total) {
    GradView v;
    v.add(0, total, grads);
    return v;
  }
  struct Seg {
    size_t begin = 0, end = 0;  // buffer offsets [begin, end)
    T* ptr = nullptr;           // the element at begin
  };
  GradView& add(size_t begin, size_t end, T* p) {
    assert(begin <= end && (p || begin == end));
    segs_.push_back({begin, end, p});
    return *this;
  }
  // Elements [off, off + n).
  T* at(size_t off, size_t n = 1) const {
    for (const Seg& s : segs_)
      if (off >= s.begin && off <= s.end && n <= s.end - off) return s.ptr + (off - s.begin);
    assert(!"a gradient offset outside the view");
    return nullptr;
  }
  const std::vector<Seg>& segments() const { return segs_; }

 private:
  std::vector<Seg> segs_;
  GradSource<T>* source_ = nullptr;
};

// Storage for offsets [begin, end) of a buffer held apart from the rest (a gathered piece, a
// gradient window), which puts each element at the address, modulo 64 bytes, that it has in a
// whole buffer starting 64-byte aligned (AlignedVector): oneDNN and OpenBLAS may take other code
// paths, hence other summation orders, for another alignment, and results must not depend on
// how the buffer is held. data() is the element at begin.
template <typename T>
class SegmentStorage {
 public:
  static_assert(kBufferAlign % sizeof(T) == 0, "elements that tile a cache line");
  SegmentStorage() = default;
  SegmentStorage(size_t begin, size_t end)
      : begin_(begin), end_(end), lead_(begin % (kBufferAlign / sizeof(T))), v_(lead_ + (end - begin)) {}
  // The same over storage used before (its contents are not cleared: the owner overwrites what
  // it reads), so a buffer can serve piece after piece without going back to the allocator.
  SegmentStorage(size_t begin, size_t end, AlignedVector<T>&& reuse)
      : begin_(begin), end_(end), lead_(begin % (kBufferAlign / sizeof(T))), v_(std::move(reuse)) {
    v_.resize(lead_ + (end - begin));
  }
  // Gives the storage back (this becomes empty).
  AlignedVector<T> take() {
    begin_ = end_ = lead_ = 0;
    return std::move(v_);
  }
  size_t begin() const { return begin_; }
  size_t end() const { return end_; }
  size_t size() const { return end_ - begin_; }
  T* data() { return v_.data() + lead_; }
  const T* data() const { return v_.data() + lead_; }

 private:
  size_t begin_ = 0, end_ = 0, lead_ = 0;
  AlignedVector<T> v_;
};

}  // namespace trn::model
