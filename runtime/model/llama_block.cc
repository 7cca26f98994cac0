// Llama's bodies (llama.h) as a composition of the shared layers (layers/block.h): RMSNorms,
// grouped-query attention with rotary embeddings and nn.Linear [out, in] weights (q, k, v fused
// into one product; Qwen2's q/k/v biases when the config has them) whose bf16 attention is the
// fp32 kernel over bf16 values, a SwiGLU MLP (gate and up fused), no position table, and an LM
// head that is its own tensor or the tied embedding.
#include "runtime/model/layers/block.h"
#include "runtime/model/llama.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace {

struct LlamaLayers {
  using Mlp = SwigluMlp;

  static BlockLayers<SwigluMlp> block(const ParamLayout& lay, int layer) {
    return shape(lay.config(), lay.placement().tp, layer >= 0 ? llama_offsets(lay, layer) : LlamaOffsets{});
  }
  static BlockLayers<SwigluMlp> shape(const Config& c, int tp, const LlamaOffsets& o = {}) {
    const int C = c.d_model, hd = c.head_dim(), H = c.n_head / tp, K = c.kv_heads() / tp, F = c.ffn() / tp;
    const float eps = float(c.norm_eps);
    const auto kOutIn = Orientation::kOutIn;
    BlockLayers<SwigluMlp> b;
    b.norm1 = {NormKind::kRMSNorm, C, eps, o.input_norm};
    b.attn.qkv = {kOutIn, o.q, o.qkv_bias, c.qkv_bias, C, (H + 2 * K) * hd};  // q, k, v adjacent
    b.attn.out = {kOutIn, o.o, 0, false, H * hd, C};                          // o_proj, row-parallel
    b.attn.H = H;
    b.attn.K = K;
    b.attn.hd = hd;
    b.attn.rope = true;
    b.attn.products = AttentionProducts::kFp32;
    b.norm2 = {NormKind::kRMSNorm, C, eps, o.post_norm};
    b.mlp.gate_up = {kOutIn, o.gate, 0, false, C, 2 * F};  // gate and up adjacent
    b.mlp.down = {kOutIn, o.down, 0, false, F, C};
    b.mlp.F = F;
    b.end = o.end;
    return b;
  }
  static Embedding embedding(const ParamLayout& lay) { return {false, 0, lay.config().d_model}; }
  static Head head(const ParamLayout& lay) {
    return {{NormKind::kRMSNorm, lay.config().d_model, float(lay.config().norm_eps), lay.final_norm.at(0)}, lay.head};
  }
};

}  // namespace

BlockCounts llama_block_counts(const Config& c) { return ComposedBody<LlamaLayers>::counts(c); }
StageFactory<float> llama_stage_f() { return stage_factory_f<ComposedBody<LlamaLayers>>(); }
StageFactory<double> llama_stage_d() { return stage_factory_d<ComposedBody<LlamaLayers>>(); }

}  // namespace trn::model
