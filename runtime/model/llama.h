// Llama (--arch llama), in Hugging Face LlamaForCausalLM's layout and names: no position table,
// pre-RMSNorm blocks without biases, grouped-query attention with rotary position embeddings,
// a SwiGLU MLP, and an LM head that is its own tensor or the token embedding (tied).
//
//   Embedding  vocabulary-parallel model.embed_tokens (layers.h)
//   Block      input_layernorm (RMSNorm) -> q, k, v projections (column-parallel by heads; tp
//              divides n_kv_head) -> RoPE on q and k -> causal attention, each KV head shared by
//              n_head / n_kv_head query heads -> o_proj (row-parallel) + residual ->
//              post_attention_layernorm -> gate and up (column-parallel) -> silu(gate) * up ->
//              down_proj (row-parallel) + residual
//   Head       model.norm -> logits over the local vocabulary rows of lm_head (or of the tied
//              embedding) -> vocabulary-parallel cross-entropy
//
// Linear weights are nn.Linear's [out, in] (y = x W^T). q, k and v of a block are adjacent in the
// buffer, so one matmul computes them into one row per token [q heads | k heads | v heads]; gate
// and up likewise into [gate | up]. llama_spec.cc lays the tensors out, llama_block.cc composes the
// shared layers (layers/block.h).
#pragma once

#include <cstddef>
#include <memory>

#include "runtime/model/config.h"
#include "runtime/model/family.h"
#include "runtime/model/layers/attention.h"  // rope_scaling

namespace trn::model {

const Family& llama_family();
const Family& mixtral_family();  // Llama blocks with a mixture of experts for the MLP (llama_spec.cc)

// A block's tensors' offsets (elements), as llama_spec.cc adds them; q, k, v and gate, up are
// adjacent (the fused projections).
// qkv_bias: the q, k and v biases, adjacent in that order ([q | k | v] like the weights); 0
// without Config::qkv_bias.
struct LlamaOffsets {
  size_t down, gate, up, post_norm, o, q, k, v, qkv_bias, input_norm;
  size_t router;    // the MoE router (mixtral; 0 for a dense MLP)
  size_t moe_bias;  // its balancing bias (Config::moe_bias; else 0)
  size_t begin, end;
};

LlamaOffsets llama_offsets(const ParamLayout& lay, int layer);

// What the planner counts of a block (family.h), from the composition of llama_block.cc.
BlockCounts llama_block_counts(const Config& c);
BlockCounts mixtral_block_counts(const Config& c);
StageFactory<float> llama_stage_f();
StageFactory<double> llama_stage_d();
StageFactory<float> mixtral_stage_f();
StageFactory<double> mixtral_stage_d();

// Its KV-cached decoder (decode.h, llama_decode.cc).
std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params);

}  // namespace trn::model
