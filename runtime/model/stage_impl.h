// The slot machine every family's stage runs (StageBody of stage.h), over the family's bodies F.
// Included by a family's block file, which instantiates it (make_stage, stage_activation_bytes)
// for float and double; nothing else includes it.
//
// F provides, for element type T and precision policy P:
//   BlockActs<T>, HeadActs<T>           a block's and the head's activations of one slot
//   block_buffers<P>(a, lay, B, Tn, fn), head_buffers<P>(...)
//                                       every buffer of them, each given to fn(vector, n) (the
//                                       constructor resizes, activation_bytes counts)
//   wide(lay), attention_row(lay)       the widest per-token matmul output of a block (scratch
//                                       dbig), and the per-token width of what Bf16Compute's
//                                       attention widens for one sequence (scratch qkv32)
//   block_output(a)                     the block's output (the next block's input)
//   scratch_buffers(lay, B, Tn, s, fn)  its own scratch and tables in BackwardScratch (extra,
//                                       tables), and prepare(lay, Tn, s), which fills the tables
//   embed_forward / embed_backward      the first stage's embedding
//   block_forward / block_backward / block_backward_weights, head_forward / head_backward
//                                       the bodies, over a policy object
//   selective_inputs(a)                 the SavedInputs of BlockActs that selective
//                                       recomputation does not keep per block, and
//   recompute_selective(pol, ...)       which computes them again before a block's backward
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/model/family.h"
#include "runtime/model/stage.h"

namespace trn::model {

template <typename T, class F>
class FamilyStage final : public StageBody<T> {
 public:
  FamilyStage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region& tp, int chunk)
      : lay_(layout), chunk_(layout.chunks().at(chunk)), chunk_index_(chunk), B_(batch), T_(seq_len), tp_(tp) {
    slots_.resize(std::max(slots, 1));
    for (Slot& s : slots_) s.blocks.resize(chunk_.end_layer - chunk_.first_layer);
    selective_ = lay_.config().recompute_selective &&
                 std::min(lay_.config().recompute, chunk_.end_layer - chunk_.first_layer) <
                     chunk_.end_layer - chunk_.first_layer;
    visit_buffers(lay_, chunk_, B_, T_, slots_, work_, shared_, dres_, scratch_, Resize{});
    F::prepare(lay_, T_, scratch_);
    chunk_end_ = lay_.chunk_range(chunk).second;
  }

  static size_t bytes(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk) {
    const Chunk& c = layout.chunks().at(chunk);
    // Empty stand-ins: nothing is allocated.
    std::vector<Slot> stand_in(std::max(slots, 1));
    for (Slot& s : stand_in) s.blocks.resize(c.end_layer - c.first_layer);
    typename F::template BlockActs<T> work, shared;
    std::vector<T> dres;
    BackwardScratch<T> scratch;
    size_t n_bytes = 0;
    visit_buffers(layout, c, batch, seq_len, stand_in, work, shared, dres, scratch, [&](const auto& v, size_t n) {
      n_bytes += n * sizeof(v[0]);  // what would be held
    });
    return n_bytes;
  }

  size_t activation_bytes() const override {
    size_t n_bytes = 0;
    visit_buffers(lay_, chunk_, B_, T_, slots_, work_, shared_, dres_, scratch_, [&](const auto& v, size_t) {
      n_bytes += v.size() * sizeof(v[0]);  // what is held
    });
    return n_bytes;
  }

  const T* output(int slot) const override { return block_input(slots_[slot], chunk_.end_layer); }
  const T* input_grad() const override { return dres_.data(); }

  double forward(int slot, const WeightView<T>& p, const int32_t* inputs, const T* hidden,
                 const int32_t* targets) override {
    Slot& s = slots_[slot];
    const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
    if (chunk_.embedding) {
      std::memcpy(s.inputs.data(), inputs, sizeof(int32_t) * N);
      const HeldPiece<T> w(p, piece(PieceKind::kEmbedding));
      F::embed_forward(lay_, w.view(), s.inputs.data(), s.x.data(), B_, T_, tp_);
    } else {
      std::memcpy(s.x.data(), hidden, sizeof(T) * N * C);
    }
    // One policy per piece, over that piece's weights (the whole view when p holds them all).
    return with_policy<T>(lay_, [&](auto policy) {
      using Policy = typename decltype(policy)::type;
      for (int l = chunk_.first_layer; l < chunk_.end_layer; ++l) {
        const HeldPiece<T> w(p, piece(PieceKind::kBlock, l));
        const Policy pol(w.view(), scratch_);
        const int i = l - chunk_.first_layer;
        if (!recomputed(lay_, chunk_, i)) {
          // Selective: the block's recomputed inputs live in the shared set while it runs.
          const Lend lend(*this, s.blocks[size_t(i)]);
          F::block_forward(pol, lay_, l, w.view(), block_input(s, l), s.blocks[i], scratch_, B_, T_, tp_);
          continue;
        }
        // Full recomputation: the activations go to the shared work set; only the output stays.
        F::block_forward(pol, lay_, l, w.view(), block_input(s, l), work_, scratch_, B_, T_, tp_);
        std::memcpy(s.outputs[size_t(i)].data(), F::block_output(work_), sizeof(T) * N * C);
      }
      if (!chunk_.head) return 0.0;
      const HeldPiece<T> w(p, piece(PieceKind::kHead));
      const Policy pol(w.view(), scratch_);
      return F::head_forward(pol, lay_, w.view(), block_input(s, chunk_.end_layer), targets, s.head, scratch_, B_, T_,
                             tp_);
    });
  }

  void backward(int slot, const WeightView<T>& p, const GradView<T>& g, T loss_scale, const T* dout,
                const std::function<void(size_t)>& prefix_done, BackwardPart part) override {
    Slot& s = slots_[slot];
    const size_t N = size_t(B_) * T_, C = lay_.config().d_model;
    auto done = [&](size_t end) {
      if (prefix_done) prefix_done(end);
    };
    with_policy<T>(lay_, [&](auto policy) {
      using Policy = typename decltype(policy)::type;
      if (chunk_.head) {
        const HeldPiece<T> w(p, piece(PieceKind::kHead));
        const Policy pol(w.view(), scratch_);
        F::head_backward(pol, lay_, w.view(), g.piece(piece(PieceKind::kHead)), block_input(s, chunk_.end_layer),
                         s.head, loss_scale, dres_.data(), scratch_, B_, T_, tp_);
        if (part == BackwardPart::kFull) done(lay_.head_end);
      } else {
        std::memcpy(dres_.data(), dout, sizeof(T) * N * C);
      }
      for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l) {
        const HeldPiece<T> w(p, piece(PieceKind::kBlock, l));
        const Policy pol(w.view(), scratch_);
        const int i = l - chunk_.first_layer;
        const bool full = recomputed(lay_, chunk_, i);
        auto& acts = full ? work_ : s.blocks[i];
        // The forward again, from the kept input, over the same weights and kernels (and the same
        // tensor-parallel sums in the same order on every tp rank): the same activations, so the
        // backward's results are those of a run that kept them. Its scratch is free here.
        if (full) F::block_forward(pol, lay_, l, w.view(), block_input(s, l), work_, scratch_, B_, T_, tp_);
        const Lend lend(*this, acts, !full);
        if (!full && selective_)
          F::recompute_selective(pol, lay_, l, w.view(), block_input(s, l), acts, scratch_, B_, T_);
        F::block_backward(pol, lay_, l, w.view(), g.piece(piece(PieceKind::kBlock, l)), block_input(s, l), acts,
                          dres_.data(), scratch_, B_, T_, tp_, done, part);
      }
    });
    // The embedding's backward reads no weight (it adds rows of dres into the gradient).
    if (chunk_.embedding) F::embed_backward(lay_, g.piece(piece(PieceKind::kEmbedding)), dres_.data(), s.inputs.data(), B_, T_);
    if (part == BackwardPart::kFull) done(chunk_end_);
  }

  void backward_weights(int slot, const GradView<T>& g) override {
    // The weight pass reads every block's kept activations (parallel::check refuses zb under
    // recomputation).
    TRN_CHECK(lay_.config().recompute == 0 && !selective_);
    Slot& s = slots_[slot];
    const WeightView<T> none;  // the weight pass reads no weight
    with_policy<T>(lay_, [&](auto policy) {
      const typename decltype(policy)::type pol(none, scratch_);
      for (int l = chunk_.end_layer - 1; l >= chunk_.first_layer; --l)
        F::block_backward_weights(pol, lay_, l, g, s.blocks[l - chunk_.first_layer], scratch_, B_, T_);
    });
  }

 private:
  struct Slot {
    std::vector<int32_t> inputs;
    std::vector<T> x;  // the stage's input: the embedding's output, or a copy of hidden
    // Each block's activations; a recomputed block's stay empty and its output is kept apart.
    std::vector<typename F::template BlockActs<T>> blocks;
    std::vector<std::vector<T>> outputs;  // the recomputed blocks' outputs (the first ones)
    typename F::template HeadActs<T> head;
  };
  struct Resize {
    template <class V>
    void operator()(V& v, size_t n) const {
      v.resize(n);
    }
  };

  Piece piece(PieceKind kind, int layer = -1) const { return {kind, chunk_index_, layer}; }

  // Under selective recomputation, lends the shared set's storage for the recomputed inputs to a
  // block's activations for one forward or backward and takes it back after (swaps: nothing is
  // copied); otherwise nothing.
  class Lend {
   public:
    Lend(FamilyStage& st, typename F::template BlockActs<T>& a, bool on = true)
        : st_(st), a_(a), on_(on && st.selective_) {
      if (on_) swap();
    }
    ~Lend() {
      if (on_) swap();
    }
    Lend(const Lend&) = delete;
    Lend& operator=(const Lend&) = delete;

   private:
    void swap() {
      const auto mine = F::selective_inputs(a_);
      const auto shared = F::selective_inputs(st_.shared_);
      for (size_t k = 0; k < mine.size(); ++k) std::swap(*mine[k], *shared[k]);
    }
    FamilyStage& st_;
    typename F::template BlockActs<T>& a_;
    bool on_;
  };

  // Whether v is one of the buffers of a's selectively recomputed inputs.
  template <class A, class V>
  static bool in_selective(A& a, const V& v) {
    const auto* at = reinterpret_cast<const char*>(&v);
    for (const auto* si : F::selective_inputs(a))
      if (at >= reinterpret_cast<const char*>(si) && at < reinterpret_cast<const char*>(si + 1)) return true;
    return false;
  }

  // Whether block i of the chunk (from its first) is recomputed in full (Config::recompute).
  static bool recomputed(const ParamLayout& lay, const Chunk&, int i) { return i < lay.config().recompute; }

  const T* block_input(const Slot& s, int layer) const {
    if (layer == chunk_.first_layer) return s.x.data();
    const int i = layer - 1 - chunk_.first_layer;
    return recomputed(lay_, chunk_, i) ? s.outputs[size_t(i)].data() : F::block_output(s.blocks[size_t(i)]);
  }

  // Every buffer of a stage: fn(vector, elements) for each, on a stage's members or on empty
  // stand-ins (Slots, Acts, Vec, Scratch: const or not). Under full recomputation a recomputed
  // block keeps its output per slot, and one work set of block activations serves them all (a
  // stage runs one forward or backward at a time).
  template <class Slots, class Acts, class Vec, class Scratch, class Fn>
  static void visit_buffers(const ParamLayout& lay, const Chunk& chunk, int B, int Tn, Slots& slots, Acts& work,
                            Acts& shared, Vec& dres, Scratch& scratch, Fn&& fn) {
    const size_t N = size_t(B) * Tn, C = lay.config().d_model;
    const size_t wide = F::wide(lay);
    const int blocks = chunk.end_layer - chunk.first_layer;
    const int n_recomputed = std::min(blocks, std::max(lay.config().recompute, 0));
    const bool selective = lay.config().recompute_selective && n_recomputed < blocks;
    with_policy<T>(lay, [&](auto policy) {
      using P = typename decltype(policy)::type;
      for (auto& s : slots) {
        if (chunk.embedding) fn(s.inputs, N);
        fn(s.x, N * C);
        if constexpr (!std::is_const_v<std::remove_reference_t<decltype(s)>>)
          s.outputs.resize(size_t(n_recomputed));
        for (int i = 0; i < blocks; ++i) {
          auto& b = s.blocks[size_t(i)];
          if (i < n_recomputed) fn(s.outputs[size_t(i)], N * C);
          else if (!selective) F::template block_buffers<P>(b, lay, B, Tn, fn);
          else  // every buffer but the selectively recomputed inputs
            F::template block_buffers<P>(b, lay, B, Tn, [&](auto& v, size_t n) {
              if (!in_selective(b, v)) fn(v, n);
            });
        }
        if (chunk.head) F::template head_buffers<P>(s.head, lay, B, Tn, fn);
      }
      if (n_recomputed > 0) F::template block_buffers<P>(work, lay, B, Tn, fn);
      if (selective)  // the shared set: the recomputed inputs only
        F::template block_buffers<P>(shared, lay, B, Tn, [&](auto& v, size_t n) {
          if (in_selective(shared, v)) fn(v, n);
        });
      fn(dres, N * C);
      fn(scratch.dtmp, N * C);
      fn(scratch.dbig, N * wide);
      const size_t widest = std::max({wide, C, chunk.head ? size_t(lay.local_vocab()) : size_t(0)});
      P::reserve_scratch(scratch, N * widest, size_t(Tn) * F::attention_row(lay), fn);
      F::scratch_buffers(lay, B, Tn, scratch, fn);
    });
  }

  const ParamLayout& lay_;
  const Chunk chunk_;
  int chunk_index_;
  size_t chunk_end_ = 0;  // where this chunk's tensors end in the buffer
  int B_, T_;
  tp::Region& tp_;
  std::vector<Slot> slots_;
  typename F::template BlockActs<T> work_;  // the recomputed blocks' activations, one at a time
  // Selective recomputation: the recomputed inputs, lent to one block at a time (Lend).
  typename F::template BlockActs<T> shared_;
  bool selective_ = false;
  std::vector<T> dres_;
  BackwardScratch<T> scratch_;
};

// The StageFactory of family F (family.h).
template <typename T, class F>
std::unique_ptr<StageBody<T>> make_stage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region& tp,
                                         int chunk) {
  return std::make_unique<FamilyStage<T, F>>(layout, batch, seq_len, slots, tp, chunk);
}

template <typename T, class F>
size_t stage_activation_bytes(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk) {
  return FamilyStage<T, F>::bytes(layout, batch, seq_len, slots, chunk);
}

template <class F>
StageFactory<float> stage_factory_f() {
  return {&make_stage<float, F>, &stage_activation_bytes<float, F>};
}
template <class F>
StageFactory<double> stage_factory_d() {
  return {&make_stage<double, F>, &stage_activation_bytes<double, F>};
}

}  // namespace trn::model
