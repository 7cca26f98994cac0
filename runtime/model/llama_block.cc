// Llama's bodies (llama.h) as a composition of the shared layers (layers/block.h): RMSNorms,
// grouped-query attention with rotary embeddings and nn.Linear [out, in] weights (q, k, v fused
// into one product; Qwen2's q/k/v biases when the config has them) whose bf16 attention is the
// fp32 kernel over bf16 values, a SwiGLU MLP (gate and up fused), no position table, and an LM
// head that is its own tensor or the tied embedding. llama_attention_layers, llama_embedding and
// llama_head are also Mixtral's (mixtral_block.cc).
#include "runtime/model/layers/block.h"
#include "runtime/model/llama.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {

void llama_attention_layers(const Config& c, int tp, const LlamaOffsets& o, Norm& norm1, Attention& attn,
                            Norm& norm2) {
  const int C = c.d_model, hd = c.head_dim(), H = c.n_head / tp, K = c.kv_heads() / tp;
  const float eps = float(c.norm_eps);
  const auto kOutIn = Orientation::kOutIn;
  norm1 = {NormKind::kRMSNorm, C, eps, o.input_norm};
  attn.qkv = {kOutIn, o.q, o.qkv_bias, c.qkv_bias, C, (H + 2 * K) * hd};  // q, k, v adjacent
  attn.out = {kOutIn, o.o, 0, false, H * hd, C};                          // o_proj, row-parallel
  attn.H = H;
  attn.K = K;
  attn.hd = hd;
  attn.rope = true;
  attn.products = AttentionProducts::kFp32;
  norm2 = {NormKind::kRMSNorm, C, eps, o.post_norm};
}

Embedding llama_embedding(const ParamLayout& lay) { return {false, 0, lay.config().d_model}; }

Head llama_head(const ParamLayout& lay) {
  return {{NormKind::kRMSNorm, lay.config().d_model, float(lay.config().norm_eps), lay.final_norm.at(0)}, lay.head};
}

namespace {

struct LlamaLayers {
  using Mlp = SwigluMlp;

  static BlockLayers<SwigluMlp> block(const ParamLayout& lay, int layer) {
    return shape(lay.config(), lay.placement().tp, layer >= 0 ? llama_offsets(lay, layer) : LlamaOffsets{});
  }
  static BlockLayers<SwigluMlp> shape(const Config& c, int tp, const LlamaOffsets& o = {}) {
    const int C = c.d_model, F = c.ffn() / tp;
    BlockLayers<SwigluMlp> b;
    llama_attention_layers(c, tp, o, b.norm1, b.attn, b.norm2);
    b.end = o.end;
    b.mlp.gate_up = {Orientation::kOutIn, o.gate, 0, false, C, 2 * F};  // gate and up adjacent
    b.mlp.down = {Orientation::kOutIn, o.down, 0, false, F, C};
    b.mlp.F = F;
    return b;
  }
  static Embedding embedding(const ParamLayout& lay) { return llama_embedding(lay); }
  static Head head(const ParamLayout& lay) { return llama_head(lay); }
};

}  // namespace

BlockCounts llama_block_counts(const Config& c) { return ComposedBody<LlamaLayers>::counts(c); }
StageFactory<float> llama_stage_f() { return stage_factory_f<ComposedBody<LlamaLayers>>(); }
StageFactory<double> llama_stage_d() { return stage_factory_d<ComposedBody<LlamaLayers>>(); }

}  // namespace trn::model
