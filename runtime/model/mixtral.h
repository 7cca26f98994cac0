// Mixtral (--arch mixtral), in Hugging Face MixtralForCausalLM's layout and names: Llama's block
// (llama.h: RMSNorms, grouped-query attention with RoPE, the same head and embedding) with the
// mixture-of-experts layer (layers/moe.h) for the MLP.
//
//   Block   input_layernorm -> Llama's attention + residual -> post_attention_layernorm ->
//           block_sparse_moe: the router (gate.weight [E, C], replicated) picks each token's top_k
//           experts; each expert is a SwiGLU MLP (w1, w3 [F, C] column-parallel, w2 [C, F]
//           row-parallel) over the rows routed to it; their outputs combined with the routing
//           weights + residual
//
// Everything else is Llama's, reused through llama.h's narrow interface (llama_validate,
// llama_add_attention, llama_attention_layers, ...). mixtral_spec.cc lays the tensors out and
// registers the family; mixtral_block.cc composes the shared layers; mixtral_decode.cc is the
// KV-cached decoder trn-generate samples with (Llama's, with the MoE layer's MLP step).
#pragma once

#include <cstddef>
#include <memory>

#include "runtime/model/config.h"
#include "runtime/model/family.h"
#include "runtime/model/llama.h"

namespace trn::model {

const Family& mixtral_family();

// A block's tensors' offsets (elements), as mixtral_spec.cc adds them: Llama's (down, gate, up
// are expert 0's w2, w1, w3 of this rank; the other experts' follow at a fixed stride), then the
// router's and the balancing bias's (Config::moe_bias; else 0).
struct MixtralOffsets {
  LlamaOffsets llama;
  size_t router, moe_bias;
};
MixtralOffsets mixtral_offsets(const ParamLayout& lay, int layer);

// What the planner counts of a block (family.h) and the stage factories, from the composition of
// mixtral_block.cc.
BlockCounts mixtral_block_counts(const Config& c);
StageFactory<float> mixtral_stage_f();
StageFactory<double> mixtral_stage_d();

// Its KV-cached decoder (decode.h, mixtral_decode.cc).
std::unique_ptr<Decoder> make_mixtral_decoder(const ParamLayout& layout, const float* params);

}  // namespace trn::model
