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
//
// Mixtral (mixtral.h) is this block with another MLP: it reuses Llama's shape rules, head,
// embedding and attention through the functions under "What a family built on Llama's block
// reuses" below, and nothing else of this file.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/model/family.h"
#include "runtime/model/layers/attention.h"  // rope_scaling

namespace trn::model {

struct Norm;
struct Attention;
struct Embedding;
struct Head;

const Family& llama_family();

// A block's tensors' offsets (elements), as llama_spec.cc adds them; q, k, v and gate, up are
// adjacent (the fused projections).
// qkv_bias: the q, k and v biases, adjacent in that order ([q | k | v] like the weights); 0
// without Config::qkv_bias.
struct LlamaOffsets {
  size_t down, gate, up, post_norm, o, q, k, v, qkv_bias, input_norm;
  size_t begin, end;
};

// The offsets of a block's first ten entries of ParamLayout::Block::at (the order llama_add_block
// and llama_add_attention push them), and its range.
LlamaOffsets llama_offsets(const ParamLayout& lay, int layer);

// What the planner counts of a block (family.h), from the composition of llama_block.cc.
BlockCounts llama_block_counts(const Config& c);
StageFactory<float> llama_stage_f();
StageFactory<double> llama_stage_d();

// What a family built on Llama's block reuses (Mixtral, mixtral.h): everything of Llama's block
// but its MLP. Its spec adds its MLP's tensors, then calls llama_add_attention, so a block's
// first three `at` entries are the MLP's and the next seven Llama's (llama_offsets reads them).
//
// Llama's shape rules (heads, KV heads, head size, RoPE, ffn_dim, norm epsilon) and tp rule (tp
// divides n_kv_head and ffn_dim), as Family::validate and check_tensor_parallel.
void llama_validate(const Config& c);
void llama_check_tp(const Config& c, int tp);
// The head's and embedding's tensors, as Family::add_head and add_embedding.
void llama_add_head(ParamLayout& lay);
void llama_add_embedding(ParamLayout& lay, const Chunk& chunk);
// The tensors of block `layer` after its MLP's, in the order backward finishes them:
// post_attention_layernorm, o_proj, q, k, v (their biases under Config::qkv_bias) and
// input_layernorm, appending seven offsets to `at` (qkv_bias: 0 without biases).
void llama_add_attention(ParamLayout& lay, int layer, std::vector<size_t>& at);
// Floating point operations of one training step per token (Family::flops_per_token), for
// blocks whose MLP multiplies mlp_weights matmul weights per token.
double llama_flops(const Config& c, int seq_len, double mlp_weights);
// A preset's shape (no MLP specifics beyond ffn_dim).
Config llama_shape(int n_layer, int n_head, int n_kv_head, int d_model, int ffn_dim, int ctx, int vocab,
                   double theta, bool tied);
// The layers of llama_block.cc around the MLP, at tensor-parallel size tp: the two RMSNorms and
// the grouped-query attention with RoPE (o: the block's offsets; default for widths only).
void llama_attention_layers(const Config& c, int tp, const LlamaOffsets& o, Norm& norm1, Attention& attn,
                            Norm& norm2);
Embedding llama_embedding(const ParamLayout& lay);
Head llama_head(const ParamLayout& lay);

// Its KV-cached decoder (decode.h, llama_decode.cc).
std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params);
// The same decoder with another MLP: mlp(layer, ln, n, y) writes y (n x d_model), the MLP's
// output for the post-attention norm's n rows ln, which the decoder adds to the residual
// (Mixtral's experts, mixtral_decode.cc).
using LlamaDecodeMlp = std::function<void(int layer, const float* ln, int n, float* y)>;
std::unique_ptr<Decoder> make_llama_decoder(const ParamLayout& layout, const float* params,
                                            LlamaDecodeMlp mlp);

}  // namespace trn::model
