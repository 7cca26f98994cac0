#include "runtime/model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>

#include "collectives/core/error.h"

namespace trn::model {

void Config::validate() const {
  if (n_layer < 1) throw usage_error("--n-layer must be at least 1 (got {})", n_layer);
  if (n_head < 1) throw usage_error("--n-head must be at least 1 (got {})", n_head);
  if (d_model < 1 || d_model % n_head != 0)
    throw usage_error("--d-model {} must be a positive multiple of --n-head {}", d_model, n_head);
  if (ctx < 1) throw usage_error("--ctx must be at least 1 (got {})", ctx);
  if (vocab < 2) throw usage_error("--vocab must be at least 2 (got {})", vocab);
  // Bounds that keep every size and offset well inside 32-bit kernel arguments.
  if (d_model > 65536) throw usage_error("--d-model {} is above the largest supported, 65536", d_model);
  if (n_layer > 4096) throw usage_error("--n-layer {} is above the largest supported, 4096", n_layer);
  if (ctx > 65536) throw usage_error("--ctx {} is above the largest supported, 65536", ctx);
  if (vocab > (1 << 20)) throw usage_error("--vocab {} is above the largest supported, {}", vocab, 1 << 20);
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

int64_t padded_vocab(const Config& c, int tp) { return (int64_t(c.vocab) + tp - 1) / tp * tp; }

void check_tensor_parallel(const Config& c, int tp) {
  if (tp < 1) throw usage_error("--tp {} must be at least 1", tp);
  if (c.n_head % tp != 0) {
    std::string fits;
    for (int t = 1; t <= c.n_head; ++t)
      if (c.n_head % t == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(t);
    throw usage_error("--tp {} does not divide n_head {} (d_model {}): each tensor-parallel rank "
                      "holds whole attention heads; use --tp one of {}",
                      tp, c.n_head, c.d_model, fits);
  }
}

int64_t TensorSpec::global_index(size_t i) const {
  if (replicated()) return int64_t(i);
  const int64_t g_dim = global_shape[shard_dim];
  const int64_t part = g_dim / interleave;  // global entries per interleaved part
  if (shape.size() == 1 || shard_dim == 0) {
    // Split along dim 0: local row r (a row has `inner` elements) is global row offset + r
    // within its part.
    const int64_t inner = shape.size() == 1 ? 1 : shape[1];
    const int64_t r = int64_t(i) / inner, c = int64_t(i) % inner;
    const int64_t p = r / shard_length, j = r % shard_length;
    const int64_t g_row = p * part + shard_offset + j;
    if (g_row >= g_dim) return -1;  // padding
    return g_row * inner + c;
  }
  // Split along dim 1 of a 2-D tensor.
  const int64_t cols = shape[1];
  const int64_t r = int64_t(i) / cols, c = int64_t(i) % cols;
  const int64_t p = c / shard_length, j = c % shard_length;
  return r * g_dim + p * part + shard_offset + j;
}

namespace {

// Calls run(local_first, global_first, count) for each contiguous run of a shard.
template <typename Fn>
void for_each_run(const TensorSpec& s, Fn run) {
  if (s.replicated()) {
    run(size_t(0), size_t(0), s.numel);
    return;
  }
  const int64_t g_dim = s.global_shape[s.shard_dim];
  const int64_t part = g_dim / s.interleave;
  if (s.shape.size() == 1 || s.shard_dim == 0) {
    const int64_t inner = s.shape.size() == 1 ? 1 : s.shape[1];
    for (int p = 0; p < s.interleave; ++p) {
      const int64_t g_first = p * part + s.shard_offset;
      const int64_t rows = std::max<int64_t>(0, std::min(s.shard_length, g_dim - g_first));
      if (rows > 0) run(size_t(p * s.shard_length * inner), size_t(g_first * inner), size_t(rows * inner));
    }
    return;
  }
  const int64_t rows = s.shape[0], cols = s.shape[1];
  for (int64_t r = 0; r < rows; ++r)
    for (int p = 0; p < s.interleave; ++p)
      run(size_t(r * cols + p * s.shard_length), size_t(r * g_dim + p * part + s.shard_offset),
          size_t(s.shard_length));
}

}  // namespace

void copy_from_global(const TensorSpec& spec, const float* global, float* local) {
  std::fill(local, local + spec.numel, 0.0f);
  for_each_run(spec, [&](size_t l, size_t g, size_t n) { std::copy(global + g, global + g + n, local + l); });
}

void copy_to_global(const TensorSpec& spec, const float* local, float* global) {
  for_each_run(spec, [&](size_t l, size_t g, size_t n) { std::copy(local + l, local + l + n, global + g); });
}

size_t ParamLayout::add(const std::string& name, std::vector<int64_t> global, int dim, int64_t offset,
                        int64_t length, int interleave) {
  TensorSpec t;
  t.name = name;
  t.global_shape = global;
  t.shape = global;
  if (dim >= 0 && p_.tp > 1) {
    t.shard_dim = dim;
    t.shard_offset = offset;
    t.shard_length = length;
    t.interleave = interleave;
    t.shape[dim] = length * interleave;
  }
  t.numel = 1;
  for (int64_t d : t.shape) t.numel *= static_cast<size_t>(d);
  t.decay = t.shape.size() == 2;
  t.offset = total_;
  total_ += t.numel;
  tensors_.push_back(std::move(t));
  return tensors_.back().offset;
}

ParamLayout::ParamLayout(const Config& c, Placement p) : c_(c), p_(std::move(p)) {
  if (p_.chunks.empty()) p_.chunks.push_back(Chunk{0, c.n_layer, true, true});
  bool ok = p_.tp >= 1 && p_.tp_rank >= 0 && p_.tp_rank < p_.tp && c.n_head % p_.tp == 0;
  int wte_holders = 0;
  for (size_t i = 0; i < p_.chunks.size(); ++i) {
    const Chunk& k = p_.chunks[i];
    ok = ok && k.first_layer >= (i ? p_.chunks[i - 1].end_layer : 0) && k.first_layer <= k.end_layer &&
         k.end_layer <= c.n_layer;
    wte_holders += k.embedding || k.head;
  }
  if (!ok || wte_holders > 1)
    throw internal_error("placement tp {} rank {} with {} chunks does not fit {}", p_.tp, p_.tp_rank,
                         p_.chunks.size(), c.describe());
  const int64_t C = c.d_model, T = p_.tp, r = p_.tp_rank;
  const int64_t Ca = C / T, Cm = 4 * C / T;
  vocab_rows_ = padded_vocab(c, p_.tp) / T;
  blocks.resize(c.n_layer);
  chunk_ranges_.resize(p_.chunks.size());
  for (auto k = p_.chunks.rbegin(); k != p_.chunks.rend(); ++k) {
    const size_t begin = total_;
    if (k->head) {
      lnf_w = add("ln_f.weight", {C});
      lnf_b = add("ln_f.bias", {C});
    }
    for (int l = k->end_layer - 1; l >= k->first_layer; --l) {
      const std::string n = fmt::format("h.{}.", l);
      BlockOffsets& b = blocks[l];
      b.begin = total_;
      b.fcproj_w = add(n + "mlp.c_proj.weight", {4 * C, C}, 0, r * Cm, Cm);      // row-parallel
      b.fcproj_b = add(n + "mlp.c_proj.bias", {C});
      b.fc_w = add(n + "mlp.c_fc.weight", {C, 4 * C}, 1, r * Cm, Cm);            // column-parallel
      b.fc_b = add(n + "mlp.c_fc.bias", {4 * C}, 0, r * Cm, Cm);
      b.ln2_w = add(n + "ln_2.weight", {C});
      b.ln2_b = add(n + "ln_2.bias", {C});
      b.attnproj_w = add(n + "attn.c_proj.weight", {C, C}, 0, r * Ca, Ca);       // row-parallel
      b.attnproj_b = add(n + "attn.c_proj.bias", {C});
      b.attn_w = add(n + "attn.c_attn.weight", {C, 3 * C}, 1, r * Ca, Ca, 3);    // column-parallel, by heads
      b.attn_b = add(n + "attn.c_attn.bias", {3 * C}, 0, r * Ca, Ca, 3);
      b.ln1_w = add(n + "ln_1.weight", {C});
      b.ln1_b = add(n + "ln_1.bias", {C});
      b.end = total_;
    }
    if (k->embedding) wpe = add("wpe.weight", {c.ctx, C});
    if (k->embedding || k->head) {
      wte = add("wte.weight", {c.vocab, C}, 0, r * vocab_rows_, vocab_rows_);
      tensors_.back().tied = true;
    }
    chunk_ranges_[size_t(std::distance(k, p_.chunks.rend()) - 1)] = {begin, total_};
  }
  // GPT-2's initialisation: LayerNorm weights 1, biases 0, the residual projections (c_proj)
  // N(0, 0.02 / sqrt(2 n_layer)), every other weight N(0, 0.02).
  const double proj_std = 0.02 / std::sqrt(2.0 * c.n_layer);
  for (TensorSpec& t : tensors_) {
    const std::string& n = t.name;
    const bool is_bias = n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
    if (is_bias) t.init = TensorSpec::Init::kZeros;
    else if (n.find("ln_") != std::string::npos) t.init = TensorSpec::Init::kOnes;
    else if (n.find("c_proj.weight") != std::string::npos) t.init_std = proj_std;
  }
}

bool ParamLayout::whole() const {
  return p_.tp == 1 && p_.chunks.size() == 1 && p_.chunks[0].first_layer == 0 &&
         p_.chunks[0].end_layer == c_.n_layer && p_.chunks[0].embedding && p_.chunks[0].head;
}

const TensorSpec* ParamLayout::find_or_null(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const TensorSpec* ParamLayout::tied() const {
  for (const auto& t : tensors_)
    if (t.tied) return &t;
  return nullptr;
}

const TensorSpec& ParamLayout::find(const std::string& name) const {
  if (const TensorSpec* t = find_or_null(name)) return *t;
  throw internal_error("no parameter named {}", name);
}

double flops_per_token(const Config& c, int seq_len) {
  const double C = c.d_model, L = c.n_layer;
  const double matmul_params = L * 12.0 * C * C + double(c.vocab) * C;
  return 6.0 * matmul_params + 12.0 * L * seq_len * C;
}

}  // namespace trn::model
