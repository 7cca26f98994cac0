#include "runtime/model/config.h"

#include <fmt/format.h>

#include "collectives/core/error.h"

namespace trn::model {

void Config::validate() const {
  if (n_layer < 1) throw usage_error("--n-layer must be at least 1 (got {})", n_layer);
  if (n_head < 1) throw usage_error("--n-head must be at least 1 (got {})", n_head);
  if (d_model < 1 || d_model % n_head != 0)
    throw usage_error("--d-model {} must be a positive multiple of --n-head {}", d_model, n_head);
  if (ctx < 1) throw usage_error("--ctx must be at least 1 (got {})", ctx);
  if (vocab < 2) throw usage_error("--vocab must be at least 2 (got {})", vocab);
}

std::string Config::describe() const {
  return fmt::format("n_layer={} n_head={} d_model={} ctx={} vocab={}", n_layer, n_head, d_model,
                     ctx, vocab);
}

Config preset(const std::string& name) {
  if (name == "tiny") return Config{2, 4, 128, 128, 256};
  if (name == "small") return Config{4, 8, 256, 256, 256};
  if (name == "gpt2") return Config{12, 12, 768, 1024, 50257};
  throw usage_error("unknown --model '{}': use tiny, small or gpt2", name);
}

size_t ParamLayout::add(const std::string& name, std::vector<int64_t> shape) {
  TensorSpec t;
  t.name = name;
  t.numel = 1;
  for (int64_t d : shape) t.numel *= static_cast<size_t>(d);
  t.decay = shape.size() == 2;
  t.shape = std::move(shape);
  t.offset = total_;
  total_ += t.numel;
  tensors_.push_back(std::move(t));
  return tensors_.back().offset;
}

ParamLayout::ParamLayout(const Config& c) {
  const int64_t C = c.d_model;
  lnf_w = add("ln_f.weight", {C});
  lnf_b = add("ln_f.bias", {C});
  blocks.resize(c.n_layer);
  for (int l = c.n_layer - 1; l >= 0; --l) {
    const std::string p = fmt::format("h.{}.", l);
    BlockOffsets& b = blocks[l];
    b.begin = total_;
    b.fcproj_w = add(p + "mlp.c_proj.weight", {4 * C, C});
    b.fcproj_b = add(p + "mlp.c_proj.bias", {C});
    b.fc_w = add(p + "mlp.c_fc.weight", {C, 4 * C});
    b.fc_b = add(p + "mlp.c_fc.bias", {4 * C});
    b.ln2_w = add(p + "ln_2.weight", {C});
    b.ln2_b = add(p + "ln_2.bias", {C});
    b.attnproj_w = add(p + "attn.c_proj.weight", {C, C});
    b.attnproj_b = add(p + "attn.c_proj.bias", {C});
    b.attn_w = add(p + "attn.c_attn.weight", {C, 3 * C});
    b.attn_b = add(p + "attn.c_attn.bias", {3 * C});
    b.ln1_w = add(p + "ln_1.weight", {C});
    b.ln1_b = add(p + "ln_1.bias", {C});
    b.end = total_;
  }
  wpe = add("wpe.weight", {c.ctx, C});
  wte = add("wte.weight", {c.vocab, C});
}

const TensorSpec& ParamLayout::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  throw internal_error("no parameter named {}", name);
}

double flops_per_token(const Config& c, int seq_len) {
  const double C = c.d_model, L = c.n_layer;
  const double matmul_params = L * 12.0 * C * C + double(c.vocab) * C;
  return 6.0 * matmul_params + 12.0 * L * seq_len * C;
}

}  // namespace trn::model
