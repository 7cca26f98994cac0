// The slot machine every family's stage runs (StageBody of stage.h), over the family's bodies F
// (layers/block.h's ComposedBody<L>, from the family's layers L). Included by a family's block
// file, which instantiates it (make_stage, stage_activation_bytes) for float and double; nothing
// else includes it.
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
//   scratch_buffers<P>(lay, B, Tn, s, fn) its own scratch and tables in BackwardScratch (extra,
//                                       tables), and prepare(lay, Tn, s), which fills the tables
//   embed_forward / embed_backward      the first stage's embedding (forward: into N x C, of
//                                       which this rank's SeqRows are computed; backward: from
//                                       all N rows)
//   block_forward / block_backward / block_backward_weights, head_forward / head_backward
//                                       the bodies, over a policy object; a block's input and
//                                       output, the head's input and the residual gradient are
//                                       this rank's SeqRows
//   selective_inputs(a)                 the SavedInputs of BlockActs that selective
//                                       recomputation does not keep per block,
//   gathered_inputs(a)                  those that sequence parallelism does not (a subset), and
//   recompute_inputs(pol, ..., tp, sel) which computes the gathered ones again before a block's
//                                       backward, and with sel the selective ones
#pragma once

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/model/family.h"
#include "runtime/model/layers.h"
#include "runtime/model/stage.h"

namespace trn::model {

template <typename T, class F>
class FamilyStage final : public StageBody<T> {
 public:
  FamilyStage(const ParamLayout& layout, int batch, int seq_len, int slots, tp::Region& tp, int chunk)
      : lay_(layout), chunk_(layout.chunks().at(chunk)), chunk_index_(chunk), B_(batch), T_(seq_len), tp_(tp) {
    slots_.resize(std::max(slots, 1));
    for (Slot& s : slots_) s.blocks.resize(chunk_.end_layer - chunk_.first_layer);
    const int blocks = chunk_.end_layer - chunk_.first_layer;
    selective_ = lay_.config().recompute_selective && std::min(lay_.config().recompute, blocks) < blocks;
    const SeqRows rows(lay_, B_, T_);
    split_ = rows.split;
    // The rows' range (SeqRows) comes from the placement, the collectives' from the region: they
    // must be the same group, and the rows must split evenly (parallel::check: tp divides T).
    if (split_ && (rows.N % size_t(tp_.size()) != 0 || tp_.size() != lay_.placement().tp ||
                   tp_.rank() != lay_.placement().tp_rank))
      throw internal_error("sequence parallelism over {} rows at tp rank {} of {} with a region of rank {} of {}",
                           rows.N, lay_.placement().tp_rank, lay_.placement().tp, tp_.rank(), tp_.size());
    visit_buffers(lay_, chunk_, B_, T_, slots_, work_, shared_, dres_, scratch_, Resize{});
    F::prepare(lay_, T_, scratch_);
    // Context parallelism: the placement says which chunks this stage's tokens are, the region's
    // cp group exchanges them; both or neither (parallel::check: 2 cp divides the sequence).
    scratch_.cp = tp_.cp_group();
    const Placement& place = lay_.placement();
    if ((place.cp > 1) != (scratch_.cp != nullptr) || (scratch_.cp && T_ % 2 != 0))
      throw internal_error("context-parallel placement {} of {} with {} group, {} tokens per sequence", place.cp_rank,
                           place.cp, scratch_.cp ? "a" : "no", T_);
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
  const T* logits(int slot) const override { return chunk_.head ? slots_[slot].head.probs.data() : nullptr; }
  const MoeCounts* moe_counts() const override { return F::report_row(lay_.config()) ? &moe_ : nullptr; }
  const T* input_grad() const override { return dres_.data(); }

  double forward(int slot, const WeightView<T>& p, const int32_t* inputs, const T* hidden,
                 const int32_t* targets) override {
    Slot& s = slots_[slot];
    const SeqRows r(lay_, B_, T_);
    const size_t C = lay_.config().d_model;
    if (chunk_.embedding) {
      std::memcpy(s.inputs.data(), inputs, sizeof(int32_t) * r.N);
      const HeldPiece<T> w(p, piece(PieceKind::kEmbedding));
      // Under sequence parallelism every row is looked up and reduce-scattered in scratch.
      T* out = split_ ? scratch_.seq.data() : s.x.data();
      F::embed_forward(lay_, w.view(), s.inputs.data(), out, B_, T_, tp_);
      if (split_) std::memcpy(s.x.data(), out + r.first * C, sizeof(T) * r.local * C);
    } else {
      std::memcpy(s.x.data(), hidden, sizeof(T) * r.local * C);
    }
    moe_.aux = 0;
    std::fill(moe_.loads.begin(), moe_.loads.end(), 0.0);
    // One policy per piece, over that piece's weights (the whole view when p holds them all).
    return with_policy<T>(lay_, [&](auto policy) {
      using Policy = typename decltype(policy)::type;
      for (int l = chunk_.first_layer; l < chunk_.end_layer; ++l) {
        const HeldPiece<T> w(p, piece(PieceKind::kBlock, l));
        const Policy pol(w.view(), scratch_);
        const int i = l - chunk_.first_layer;
        if (!recomputed(lay_, chunk_, i)) {
          // Selective or sequence-parallel: the block's recomputed inputs live in the shared set
          // while it runs.
          const Lend lend(*this, s.blocks[size_t(i)]);
          F::block_forward(pol, lay_, l, w.view(), block_input(s, l), s.blocks[i], scratch_, B_, T_, tp_);
          note_moe(l, s.blocks[size_t(i)]);
          continue;
        }
        // Full recomputation: the activations go to the shared work set; only the output stays.
        F::block_forward(pol, lay_, l, w.view(), block_input(s, l), work_, scratch_, B_, T_, tp_);
        note_moe(l, work_);
        std::memcpy(s.outputs[size_t(i)].data(), F::block_output(work_), sizeof(T) * r.local * C);
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
    const SeqRows r(lay_, B_, T_);
    const size_t C = lay_.config().d_model;
    // A zero-bubble input pass keeps whole output gradients, which SP does not hold (parallel::check).
    TRN_CHECK(part == BackwardPart::kFull || !split_);
    auto done = [&](size_t end) {
      if (prefix_done) prefix_done(end);
    };
    scratch_.loss_scale = loss_scale;
    with_policy<T>(lay_, [&](auto policy) {
      using Policy = typename decltype(policy)::type;
      if (chunk_.head) {
        const HeldPiece<T> w(p, piece(PieceKind::kHead));
        const Policy pol(w.view(), scratch_);
        F::head_backward(pol, lay_, w.view(), g.piece(piece(PieceKind::kHead)), block_input(s, chunk_.end_layer),
                         s.head, loss_scale, dres_.data(), scratch_, B_, T_, tp_);
        if (part == BackwardPart::kFull) done(lay_.head_end);
      } else {
        std::memcpy(dres_.data(), dout, sizeof(T) * r.local * C);
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
        if (!full && (selective_ || split_))
          F::recompute_inputs(pol, lay_, l, w.view(), block_input(s, l), acts, scratch_, B_, T_, tp_, selective_);
        F::block_backward(pol, lay_, l, w.view(), g.piece(piece(PieceKind::kBlock, l)), block_input(s, l), acts,
                          dres_.data(), scratch_, B_, T_, tp_, done, part);
      }
    });
    // The embedding's backward reads no weight (it adds rows of dres into the gradient): every
    // row, gathered under sequence parallelism.
    if (chunk_.embedding)
      F::embed_backward(lay_, g.piece(piece(PieceKind::kEmbedding)),
                        gather_rows(r, tp_, dres_.data(), scratch_.seq.data(), C), s.inputs.data(), B_, T_);
    if (part == BackwardPart::kFull) done(chunk_end_);
  }

  void backward_weights(int slot, const GradView<T>& g) override {
    // The weight pass reads every block's kept activations (parallel::check refuses zb under
    // recomputation and sequence parallelism).
    TRN_CHECK(lay_.config().recompute == 0 && !selective_ && !split_);
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

  // A family whose MLP reports (the MoE layer: each block's balancing loss and expert loads,
  // F::moe_note) fills its row of report_row counts per layer; others have none.
  template <class A>
  void note_moe(int layer, const A& a) {
    if constexpr (requires { F::moe_note(a, &moe_.aux, moe_.loads.data()); }) {
      const size_t row = F::report_row(lay_.config());
      if (!row) return;
      if (moe_.loads.empty()) moe_.loads.assign(size_t(lay_.config().n_layer) * row, 0.0);
      F::moe_note(a, &moe_.aux, moe_.loads.data() + size_t(layer) * row);
    }
  }

  // Under selective recomputation or sequence parallelism, lends the shared set's storage for the
  // recomputed inputs to a block's activations for one forward or backward and takes it back
  // after (swaps: nothing is copied); otherwise nothing.
  class Lend {
   public:
    Lend(FamilyStage& st, typename F::template BlockActs<T>& a, bool on = true)
        : st_(st), a_(a), on_(on && (st.selective_ || st.split_)) {
      if (on_) swap();
    }
    ~Lend() {
      if (on_) swap();
    }
    Lend(const Lend&) = delete;
    Lend& operator=(const Lend&) = delete;

   private:
    void swap() {
      const auto mine = shared_inputs(a_, st_.selective_);
      const auto shared = shared_inputs(st_.shared_, st_.selective_);
      for (size_t k = 0; k < mine.size(); ++k) std::swap(*mine[k], *shared[k]);
    }
    FamilyStage& st_;
    typename F::template BlockActs<T>& a_;
    bool on_;
  };

  // The SavedInputs of a that live in the shared set: the selective ones under selective
  // recomputation, else (sequence parallelism) the gathered ones.
  template <class A>
  static auto shared_inputs(A& a, bool selective) {
    using Ptr = typename decltype(F::selective_inputs(a))::value_type;
    std::vector<Ptr> v;
    if (selective)
      for (Ptr p : F::selective_inputs(a)) v.push_back(p);
    else
      for (Ptr p : F::gathered_inputs(a)) v.push_back(p);
    return v;
  }

  // Whether v is one of the buffers of a's shared inputs.
  template <class A, class V>
  static bool in_shared(A& a, const V& v, bool selective) {
    const auto* at = reinterpret_cast<const char*>(&v);
    for (const auto* si : shared_inputs(a, selective))
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
    const SeqRows r(lay, B, Tn);
    const size_t N = r.N, C = lay.config().d_model;
    const size_t wide = F::wide(lay);
    const int blocks = chunk.end_layer - chunk.first_layer;
    const int n_recomputed = std::min(blocks, std::max(lay.config().recompute, 0));
    const bool selective = lay.config().recompute_selective && n_recomputed < blocks;
    const bool lent = selective || r.split;  // whether the blocks kept per slot lend a shared set
    with_policy<T>(lay, [&](auto policy) {
      using P = typename decltype(policy)::type;
      for (auto& s : slots) {
        if (chunk.embedding) fn(s.inputs, N);
        fn(s.x, r.local * C);
        if constexpr (!std::is_const_v<std::remove_reference_t<decltype(s)>>)
          s.outputs.resize(size_t(n_recomputed));
        for (int i = 0; i < blocks; ++i) {
          auto& b = s.blocks[size_t(i)];
          if (i < n_recomputed) fn(s.outputs[size_t(i)], r.local * C);
          else if (!lent) F::template block_buffers<P>(b, lay, B, Tn, fn);
          else  // every buffer but the shared inputs
            F::template block_buffers<P>(b, lay, B, Tn, [&](auto& v, size_t n) {
              if (!in_shared(b, v, selective)) fn(v, n);
            });
        }
        if (chunk.head) F::template head_buffers<P>(s.head, lay, B, Tn, fn);
      }
      if (n_recomputed > 0) F::template block_buffers<P>(work, lay, B, Tn, fn);
      if (lent && n_recomputed < blocks)  // the shared set: the recomputed inputs only
        F::template block_buffers<P>(shared, lay, B, Tn, [&](auto& v, size_t n) {
          if (in_shared(shared, v, selective)) fn(v, n);
        });
      fn(dres, r.local * C);
      if (r.split) {
        fn(scratch.seq, N * C);
        fn(scratch.dnorm, 2 * C);
      }
      // dtmp takes C-wide rows and the attention's output or its gradient (wider with an explicit
      // head_dim: heads x head_dim above d_model).
      fn(scratch.dtmp, N * std::max(C, size_t(lay.local_attn())));
      fn(scratch.dbig, N * wide);
      const size_t widest = std::max({wide, C, chunk.head ? size_t(lay.local_vocab()) : size_t(0)});
      P::reserve_scratch(scratch, N * widest, size_t(Tn) * F::attention_row(lay), fn);
      F::template scratch_buffers<P>(lay, B, Tn, scratch, fn);
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
  // Selective recomputation or sequence parallelism: the recomputed inputs, lent to one block at a
  // time (Lend).
  typename F::template BlockActs<T> shared_;
  bool selective_ = false;
  bool split_ = false;  // sequence parallelism (SeqRows::split)
  MoeCounts moe_;  // what the last forward's MoE blocks reported
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
