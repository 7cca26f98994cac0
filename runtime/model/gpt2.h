// GPT-2 (--arch gpt2, the default): learned positions, pre-LayerNorm blocks with biases,
// multi-head attention, a GELU MLP of 4 d_model, and the LM head tied to the token embedding.
//
//   Embedding  vocabulary-parallel wte (rows split) + wpe; the partial sums are all-reduced
//   Block      ln_1 -> c_attn (column-parallel, by heads) -> attention over the local heads ->
//              attn.c_proj (row-parallel: all-reduce, then bias and residual) -> ln_2 -> c_fc
//              (column-parallel) -> GELU -> mlp.c_proj (row-parallel); backward all-reduces the
//              column-parallel layers' input gradients
//   Head       ln_f -> logits over the local vocabulary rows of the tied wte -> vocabulary-
//              parallel cross-entropy (layers.h)
//
// Hugging Face GPT-2 names and shapes: linear weights are Conv1D's [in, out] (y = x W + b).
// gpt2_spec.cc lays the tensors out, gpt2_block.cc composes the shared layers (layers/block.h).
#pragma once

#include <cstddef>
#include <memory>

#include "runtime/model/config.h"
#include "runtime/model/family.h"

namespace trn::model {

const Family& gpt2_family();

// A block's tensors' offsets (elements), as gpt2_spec.cc adds them; begin and end bound the
// block in the buffer.
struct Gpt2Offsets {
  size_t ln1_w, ln1_b, attn_w, attn_b, attnproj_w, attnproj_b;
  size_t ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
  size_t begin, end;
};
Gpt2Offsets gpt2_offsets(const ParamLayout& lay, int layer);

// The stage factories of gpt2_block.cc.
// What the planner counts of a block (family.h), from the composition of gpt2_block.cc.
BlockCounts gpt2_block_counts(const Config& c);
StageFactory<float> gpt2_stage_f();
StageFactory<double> gpt2_stage_d();

// Its KV-cached decoder (decode.h, gpt2_decode.cc).
std::unique_ptr<Decoder> make_gpt2_decoder(const ParamLayout& layout, const float* params);

}  // namespace trn::model
