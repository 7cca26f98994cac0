// Mixtral's bodies (mixtral.h) as a composition of the shared layers (layers/block.h): Llama's
// norms, attention, embedding and head (llama.h) around the MoE layer (layers/moe.h).
#include "runtime/model/layers/block.h"
#include "runtime/model/layers/moe.h"
#include "runtime/model/mixtral.h"
#include "runtime/model/stage_impl.h"

namespace trn::model {
namespace {

// The experts' tensors follow expert 0's at a fixed stride (mixtral_spec.cc add_experts: w2, w1,
// w3).
struct MixtralLayers {
  using Mlp = MoeMlp;

  static BlockLayers<MoeMlp> block(const ParamLayout& lay, int layer) {
    BlockLayers<MoeMlp> b =
        shape(lay.config(), lay.placement().tp, layer >= 0 ? mixtral_offsets(lay, layer) : MixtralOffsets{});
    b.mlp.El = lay.local_experts();  // expert parallelism: this rank's experts
    b.mlp.first = lay.first_expert();
    return b;
  }
  static BlockLayers<MoeMlp> shape(const Config& c, int tp, const MixtralOffsets& m = {}) {
    const int C = c.d_model, F = c.ffn() / tp;
    const LlamaOffsets& o = m.llama;
    BlockLayers<MoeMlp> b;
    llama_attention_layers(c, tp, o, b.norm1, b.attn, b.norm2);
    b.end = o.end;
    b.mlp.router = {Orientation::kOutIn, m.router, 0, false, C, c.n_experts};
    b.mlp.down0 = o.down;
    b.mlp.gate_up0 = o.gate;
    b.mlp.stride = 3 * size_t(C) * size_t(F);
    b.mlp.bias = m.moe_bias;
    b.mlp.C = C;
    b.mlp.F = F;
    b.mlp.E = c.n_experts;
    b.mlp.El = c.n_experts;
    b.mlp.k = c.top_k;
    b.mlp.norm_topk = c.moe_norm_topk;
    b.mlp.capacity = c.capacity_factor;
    b.mlp.aux_coef = c.moe_aux_coef;
    return b;
  }
  static Embedding embedding(const ParamLayout& lay) { return llama_embedding(lay); }
  static Head head(const ParamLayout& lay) { return llama_head(lay); }
};

}  // namespace

BlockCounts mixtral_block_counts(const Config& c) { return ComposedBody<MixtralLayers>::counts(c); }
StageFactory<float> mixtral_stage_f() { return stage_factory_f<ComposedBody<MixtralLayers>>(); }
StageFactory<double> mixtral_stage_d() { return stage_factory_d<ComposedBody<MixtralLayers>>(); }

}  // namespace trn::model
