// The GPT-2 model in pieces, each a forward and a backward over flat buffers (llm.c style), with
// Megatron's tensor-parallel split and its communication points (tp::Region) inside them:
//
//   Embedding  vocabulary-parallel wte (rows split) + wpe; the partial sums are all-reduced
//   Block      ln_1 -> c_attn (column-parallel, by heads) -> attention over the local heads ->
//              attn.c_proj (row-parallel: all-reduce, then bias and residual) -> ln_2 -> c_fc
//              (column-parallel) -> GELU -> mlp.c_proj (row-parallel); backward all-reduces the
//              column-parallel layers' input gradients
//   Head       ln_f -> logits over the local vocabulary rows of the tied wte -> vocabulary-
//              parallel cross-entropy (max and sums all-reduced per token: the [B, T, V] logits
//              are never gathered); padding rows of the vocabulary never enter the softmax
//
// A Stage composes them: the blocks of one chunk of its ParamLayout, with the embedding in front
// on the first pipeline stage and the head behind on the last. One process is the
// stage that holds everything. Activations live in slots, one per micro-batch in flight, so a
// pipeline schedule can run forwards of several micro-batches before their backwards.
//
// Templated on the element type: Stage<float> runs the fast kernels; Stage<double> the reference
// kernels in double precision, which the tests check against finite differences.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/tensor_parallel/region.h"

namespace trn::model {

template <typename T>
struct BlockActivations {
  std::vector<T> ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu, res3;
  // The output gradients of the four matmuls, kept by an input-only backward for the weight pass
  // (zero-bubble schedules): mlp.c_proj, mlp.c_fc, attn.c_proj, attn.c_attn.
  std::vector<T> d_fcproj, d_fc, d_attnproj, d_attn;
};

// What a backward computes: everything, or (zero-bubble pipelines) first the input gradient with
// the LayerNorms', the head's and the embedding's gradients, and later the blocks' matmul weight
// and bias gradients.
enum class BackwardPart { kFull, kInput, kWeight };

template <typename T>
struct HeadActivations {
  std::vector<T> lnf, lnf_mean, lnf_rstd, probs, losses;
  std::vector<int32_t> targets;
};

// Scratch for backward, shared by every piece of a stage (one micro-batch at a time).
template <typename T>
struct BackwardScratch {
  std::vector<T> dtmp, dbig, datt, dsmall;
};

template <typename T>
class Embedding {
 public:
  // out (N,C) = wte[tok] + wpe[t] for tokens (B,T); wte rows outside this rank's slice add 0.
  static void forward(const ParamLayout& lay, const T* p, const int32_t* tok, T* out, int B, int Tn,
                      tp::Region& tp);
  // dwte (local rows), dwpe += from dout (B,T,C).
  static void backward(const ParamLayout& lay, T* g, const T* dout, const int32_t* tok, int B, int Tn);
};

template <typename T>
class Block {
 public:
  static void allocate(BlockActivations<T>& a, const ParamLayout& lay, int B, int Tn);
  // a.res3 = block(in), in (B,T,C).
  static void forward(const ParamLayout& lay, int layer, const T* p, const T* in, BlockActivations<T>& a, int B,
                      int Tn, tp::Region& tp);
  // dres: the gradient of a.res3 on entry, of `in` on exit. done(n): the first n gradient
  // elements are final.
  static void backward(const ParamLayout& lay, int layer, const T* p, T* g, const T* in,
                       BlockActivations<T>& a, T* dres, BackwardScratch<T>& s, int B, int Tn,
                       tp::Region& tp, const std::function<void(size_t)>& done,
                       BackwardPart part = BackwardPart::kFull);
  // The weight pass after an input-only backward: the four matmuls' weight and bias gradients.
  static void backward_weights(const ParamLayout& lay, int layer, T* g, const BlockActivations<T>& a, int B, int Tn);
};

template <typename T>
class Head {
 public:
  static void allocate(HeadActivations<T>& a, const ParamLayout& lay, int B, int Tn);
  // Returns the sum of the token losses of in (B,T,C) against targets; targets null: logits
  // only (left, unnormalised, in a.probs).
  static double forward(const ParamLayout& lay, const T* p, const T* in, const int32_t* targets,
                        HeadActivations<T>& a, int B, int Tn, tp::Region& tp);
  // dres (B,T,C) = the gradient of in (overwritten) of loss_scale * sum of token losses.
  static void backward(const ParamLayout& lay, const T* p, T* g, const T* in, HeadActivations<T>& a, T loss_scale,
                       T* dres, BackwardScratch<T>& s, int B, int Tn, tp::Region& tp);
};

template <typename T>
class Stage {
 public:
  // Chunk `chunk` of layout, with activations for `slots` micro-batches of `batch` sequences of
  // `seq_len` tokens.
  Stage(const ParamLayout& layout, int batch, int seq_len, int slots = 1, tp::Region* tp = nullptr, int chunk = 0);

  int batch() const { return B_; }
  int seq_len() const { return T_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  bool first() const { return chunk_.embedding; }
  bool last() const { return chunk_.head; }

  // First stage: inputs are (B,T) token ids; otherwise hidden is the (B,T,C) input. Last stage:
  // returns the sum (not the mean) of the B*T token losses (targets null: logits only);
  // otherwise 0, and output(slot) holds the (B,T,C) result.
  double forward(int slot, const T* params, const int32_t* inputs, const T* hidden, const int32_t* targets);
  // Adds the gradient into grads: on the last stage of loss_scale * sum of token losses, on the
  // others given dout, the gradient of output(slot). Needs slot's forward. After each group of
  // tensors is final, calls prefix_done(n) with the number of leading elements of the gradient
  // buffer that this backward will not touch again (a full backward only: after kInput the
  // weights are still to come). Afterwards input_grad() holds the gradient of the hidden input
  // (stages after the first).
  void backward(int slot, const T* params, T* grads, T loss_scale, const T* dout,
                const std::function<void(size_t)>& prefix_done, BackwardPart part = BackwardPart::kFull);
  // After backward(..., kInput) of slot: the blocks' matmul weight gradients (the W of
  // zero-bubble schedules). Adds into grads in the order a full backward would.
  void backward_weights(int slot, T* grads);

  const T* output(int slot) const;
  const T* input_grad() const { return dres_.data(); }
  size_t activation_bytes() const;

 private:
  struct Slot {
    std::vector<int32_t> inputs;
    std::vector<T> x;  // the stage's input: the embedding's output, or a copy of hidden
    std::vector<BlockActivations<T>> blocks;
    HeadActivations<T> head;
  };
  const T* block_input(const Slot& s, int layer) const;

  const ParamLayout& lay_;
  const Chunk chunk_;
  size_t chunk_end_ = 0;  // where this chunk's tensors end in the buffer
  int B_, T_;
  tp::Region& tp_;
  std::vector<Slot> slots_;
  std::vector<T> dres_;
  BackwardScratch<T> scratch_;
};

extern template class Stage<float>;
extern template class Stage<double>;

}  // namespace trn::model
