// Llama's bodies (llama.h) as a composition of the shared layers (layers/block.h): RMSNorms,
// grouped-query attention with rotary embeddings and nn.Linear [out, in] weights (q, k, v fused
// into one product; Qwen2's q/k/v biases when the config has them) whose bf16 attention is the
// fp32 kernel over bf16 values, a SwiGLU MLP (gate and up fused), no position table, and an LM
// head that is its own tensor or the tied embedding. Mixtral's blocks are the same with the MoE
// layer (layers/moe.h) for the MLP.
#include "runtime/model/layers/block.h"
#include "runtime/model/layers/moe.h"
#include "runtime/model/llama.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace {

// Llama's norms and attention at tensor-parallel size tp, around an MLP of type Mlp that the
// caller fills.
template <class Mlp>
BlockLayers<Mlp> llama_layers(const Config& c, int tp, const LlamaOffsets& o) {
  const int C = c.d_model, hd = c.head_dim(), H = c.n_head / tp, K = c.kv_heads() / tp;
  const float eps = float(c.norm_eps);
  const auto kOutIn = Orientation::kOutIn;
  BlockLayers<Mlp> b;
  b.norm1 = {NormKind::kRMSNorm, C, eps, o.input_norm};
  b.attn.qkv = {kOutIn, o.q, o.qkv_bias, c.qkv_bias, C, (H + 2 * K) * hd};  // q, k, v adjacent
  b.attn.out = {kOutIn, o.o, 0, false, H * hd, C};                          // o_proj, row-parallel
  b.attn.H = H;
  b.attn.K = K;
  b.attn.hd = hd;
  b.attn.rope = true;
  b.attn.products = AttentionProducts::kFp32;
  b.norm2 = {NormKind::kRMSNorm, C, eps, o.post_norm};
  b.end = o.end;
  return b;
}

struct LlamaLayers {
  using Mlp = SwigluMlp;

  static BlockLayers<SwigluMlp> block(const ParamLayout& lay, int layer) {
    return shape(lay.config(), lay.placement().tp, layer >= 0 ? llama_offsets(lay, layer) : LlamaOffsets{});
  }
  static BlockLayers<SwigluMlp> shape(const Config& c, int tp, const LlamaOffsets& o = {}) {
    const int C = c.d_model, F = c.ffn() / tp;
    BlockLayers<SwigluMlp> b = llama_layers<SwigluMlp>(c, tp, o);
    b.mlp.gate_up = {Orientation::kOutIn, o.gate, 0, false, C, 2 * F};  // gate and up adjacent
    b.mlp.down = {Orientation::kOutIn, o.down, 0, false, F, C};
    b.mlp.F = F;
    return b;
  }
  static Embedding embedding(const ParamLayout& lay) { return {false, 0, lay.config().d_model}; }
  static Head head(const ParamLayout& lay) {
    return {{NormKind::kRMSNorm, lay.config().d_model, float(lay.config().norm_eps), lay.final_norm.at(0)}, lay.head};
  }
};

// Mixtral (llama_spec.cc mixtral_family): Llama's block with the MoE layer for the MLP. The
// experts' tensors follow expert 0's at a fixed stride (llama_spec.cc add_experts: w2, w1, w3).
struct MixtralLayers : LlamaLayers {
  using Mlp = MoeMlp;

  static BlockLayers<MoeMlp> block(const ParamLayout& lay, int layer) {
    BlockLayers<MoeMlp> b =
        shape(lay.config(), lay.placement().tp, layer >= 0 ? llama_offsets(lay, layer) : LlamaOffsets{});
    b.mlp.El = lay.local_experts();  // expert parallelism: this rank's experts
    b.mlp.first = lay.first_expert();
    return b;
  }
  static BlockLayers<MoeMlp> shape(const Config& c, int tp, const LlamaOffsets& o = {}) {
    const int C = c.d_model, F = c.ffn() / tp;
    BlockLayers<MoeMlp> b = llama_layers<MoeMlp>(c, tp, o);
    b.mlp.router = {Orientation::kOutIn, o.router, 0, false, C, c.n_experts};
    b.mlp.down0 = o.down;
    b.mlp.gate_up0 = o.gate;
    b.mlp.stride = 3 * size_t(C) * size_t(F);
    b.mlp.bias = o.moe_bias;
    b.mlp.C = C;
    b.mlp.F = F;
    b.mlp.E = c.n_experts;
    b.mlp.El = c.n_experts;
    b.mlp.k = c.top_k;
    b.mlp.norm_topk = c.moe_norm_topk;
    b.mlp.capacity = c.capacity_factor;
    return b;
  }
};

}  // namespace

BlockCounts llama_block_counts(const Config& c) { return ComposedBody<LlamaLayers>::counts(c); }
BlockCounts mixtral_block_counts(const Config& c) { return ComposedBody<MixtralLayers>::counts(c); }
StageFactory<float> llama_stage_f() { return stage_factory_f<ComposedBody<LlamaLayers>>(); }
StageFactory<double> llama_stage_d() { return stage_factory_d<ComposedBody<LlamaLayers>>(); }
StageFactory<float> mixtral_stage_f() { return stage_factory_f<ComposedBody<MixtralLayers>>(); }
StageFactory<double> mixtral_stage_d() { return stage_factory_d<ComposedBody<MixtralLayers>>(); }

}  // namespace trn::model
