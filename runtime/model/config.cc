#include "runtime/model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>

#include "collectives/core/error.h"
#include "runtime/model/family.h"

namespace trn::model {

namespace {

// The shape fields describe() and parse_config() know, by their key.
struct Field {
  const char* key;
  int Config::*i = nullptr;
  double Config::*d = nullptr;
  bool Config::*b = nullptr;
};
const Field kFields[] = {
    {"n_layer", &Config::n_layer},         {"n_head", &Config::n_head},
    {"n_kv_head", &Config::n_kv_head},     {"d_model", &Config::d_model},
    {"ffn_dim", &Config::ffn_dim},         {"ctx", &Config::ctx},
    {"vocab", &Config::vocab},             {"rope_theta", nullptr, &Config::rope_theta},
    {"norm_eps", nullptr, &Config::norm_eps}, {"tie_embeddings", nullptr, nullptr, &Config::tie_embeddings},
    {"head_dim", &Config::head_size},      {"qkv_bias", nullptr, nullptr, &Config::qkv_bias},
    {"rope_factor", nullptr, &Config::rope_factor},
    {"rope_low_freq_factor", nullptr, &Config::rope_low_freq_factor},
    {"rope_high_freq_factor", nullptr, &Config::rope_high_freq_factor},
    {"rope_original_ctx", &Config::rope_original_ctx},
    {"n_experts", &Config::n_experts},     {"top_k", &Config::top_k},
    {"moe_norm_topk", nullptr, nullptr, &Config::moe_norm_topk},
    {"moe_bias", nullptr, nullptr, &Config::moe_bias},
};

const Field& field(const std::string& key) {
  for (const Field& f : kFields)
    if (key == f.key) return f;
  throw internal_error("a family lists the unknown shape field {}", key);
}

std::string value_of(const Config& c, const Field& f) {
  if (f.i) return std::to_string(c.*f.i);
  if (f.d) return fmt::format("{}", c.*f.d);
  return c.*f.b ? "1" : "0";
}

}  // namespace

void Config::validate() const {
  const Family& f = family(arch);
  if (n_layer < 1) throw usage_error("--n-layer must be at least 1 (got {})", n_layer);
  if (n_head < 1) throw usage_error("--n-head must be at least 1 (got {})", n_head);
  if (d_model < 1 || (head_size == 0 && d_model % n_head != 0))
    throw usage_error("--d-model {} must be a positive multiple of --n-head {}", d_model, n_head);
  if (head_size < 0 || head_size > 1024) throw usage_error("head_dim {} must be between 1 and 1024", head_size);
  if (ctx < 1) throw usage_error("--ctx must be at least 1 (got {})", ctx);
  if (vocab < 2) throw usage_error("--vocab must be at least 2 (got {})", vocab);
  // Bounds that keep every size and offset well inside 32-bit kernel arguments.
  if (d_model > 65536) throw usage_error("--d-model {} is above the largest supported, 65536", d_model);
  // Attention's widths (q, k, v and the output: heads x head_dim) are ints in the kernels; without
  // an explicit head_dim they are d_model's.
  if (head_size > 0 && int64_t(n_head) * head_size > 65536)
    throw usage_error("--n-head {} x head_dim {} is above the largest supported attention width, 65536", n_head,
                      head_size);
  if (n_layer > 4096) throw usage_error("--n-layer {} is above the largest supported, 4096", n_layer);
  if (ctx > (1 << 17)) throw usage_error("--ctx {} is above the largest supported, {}", ctx, 1 << 17);
  if (vocab > (1 << 20)) throw usage_error("--vocab {} is above the largest supported, {}", vocab, 1 << 20);
  f.validate(*this);
}

std::string Config::describe() const {
  const Family& f = family(arch);
  std::string out = f.name == "gpt2" ? "" : "arch=" + f.name;
  for (const std::string& key : f.fields)
    out += (out.empty() ? "" : " ") + key + "=" + value_of(*this, field(key));
  // An explicit head_dim equal to d_model / n_head is the default one: one model, one spelling
  // (checkpoint manifests compare these strings).
  Config canonical = *this;
  if (head_size > 0 && d_model % n_head == 0 && head_size == d_model / n_head) canonical.head_size = 0;
  const Config defaults;
  for (const std::string& key : f.optional_fields)
    if (value_of(canonical, field(key)) != value_of(defaults, field(key)))
      out += (out.empty() ? "" : " ") + key + "=" + value_of(canonical, field(key));
  return out;
}

std::string Config::flags() const {
  const Family& f = family(arch);
  Config resolved = *this;
  resolved.n_kv_head = kv_heads();
  resolved.ffn_dim = ffn();
  std::string out = "--arch " + f.name;
  for (std::string key : f.fields) {
    const std::string value = value_of(resolved, field(key));
    std::replace(key.begin(), key.end(), '_', '-');
    out += " --" + key + " " + value;
  }
  return out;
}

Config parse_config(const std::string& described) {
  auto bad = [&](const std::string& why) {
    return usage_error("\"{}\" names no model trn can build: {}", described, why);
  };
  std::vector<std::string> words;
  for (size_t at = 0; at <= described.size();) {
    const size_t sp = std::min(described.find(' ', at), described.size());
    words.push_back(described.substr(at, sp - at));
    at = sp + 1;
  }
  Config c;
  size_t w = 0;
  if (!words.empty() && words[0].rfind("arch=", 0) == 0) {
    c.arch = words[0].substr(5);
    w = 1;
  }
  const Family* fam = nullptr;
  for (const Family* f : families())
    if (f->name == c.arch) fam = f;
  if (!fam) throw bad("unknown arch '" + c.arch + "'");
  if (words.size() - w < fam->fields.size() || words.size() - w > fam->fields.size() + fam->optional_fields.size())
    throw bad(fmt::format("{} needs the fields {}", fam->name, fmt::join(fam->fields, ", ")));
  // The fields in order, then those optional ones present (in their order: the canonical-form
  // check below refuses any other).
  std::vector<std::string> keys = fam->fields;
  for (size_t i = w + fam->fields.size(); i < words.size(); ++i) {
    const std::string key = words[i].substr(0, words[i].find('='));
    if (std::find(fam->optional_fields.begin(), fam->optional_fields.end(), key) == fam->optional_fields.end())
      throw bad(fmt::format("'{}' is not a field of {}", words[i], fam->name));
    keys.push_back(key);
  }
  for (const std::string& key : keys) {
    const std::string& word = words[w++];
    const Field& f = field(key);
    if (word.size() <= key.size() + 1 || word.compare(0, key.size(), key) != 0 || word[key.size()] != '=')
      throw bad(fmt::format("expected {}=VALUE, got '{}'", key, word));
    const char* v = word.data() + key.size() + 1;
    const char* end = word.data() + word.size();
    std::from_chars_result r{};
    if (f.i) {
      r = std::from_chars(v, end, c.*f.i);
    } else if (f.d) {
      r = std::from_chars(v, end, c.*f.d);
    } else {
      int b = -1;
      r = std::from_chars(v, end, b);
      if (b != 0 && b != 1) r.ec = std::errc::invalid_argument;
      c.*f.b = b == 1;
    }
    if (r.ec != std::errc() || r.ptr != end) throw bad(fmt::format("'{}' is not a value of {}", word, key));
  }
  // Only the canonical form: what describe() writes back must be the same text.
  if (c.describe() != described) throw bad("it is not in the form trn writes (\"" + c.describe() + "\")");
  c.validate();
  return c;
}

Config preset(const std::string& name) {
  std::vector<std::string> names;
  for (const Family* f : families())
    for (const Preset& p : f->presets) {
      if (p.name == name) return p.config;
      names.push_back(p.name);
    }
  throw usage_error("unknown --model '{}': use {}", name, fmt::join(names, ", "));
}

int64_t padded_vocab(const Config& c, int tp) { return (int64_t(c.vocab) + tp - 1) / tp * tp; }

void check_tensor_parallel(const Config& c, int tp) {
  if (tp < 1) throw usage_error("--tp {} must be at least 1", tp);
  family(c.arch).check_tensor_parallel(c, tp);
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
void each_run(const TensorSpec& s, Fn run) {
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

void for_each_run(const TensorSpec& spec, const std::function<void(size_t, size_t, size_t)>& run) {
  each_run(spec, run);
}

void copy_from_global(const TensorSpec& spec, const float* global, float* local) {
  std::fill(local, local + spec.numel, 0.0f);
  each_run(spec, [&](size_t l, size_t g, size_t n) { std::copy(global + g, global + g + n, local + l); });
}

void copy_to_global(const TensorSpec& spec, const float* local, float* global) {
  each_run(spec, [&](size_t l, size_t g, size_t n) { std::copy(local + l, local + l + n, global + g); });
}

TensorSpec& ParamLayout::add(const std::string& name, std::vector<int64_t> global, int dim, int64_t offset,
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
  return tensors_.back();
}

ParamLayout::ParamLayout(const Config& c, Placement p) : c_(c), p_(std::move(p)) {
  const Family& fam = family(c.arch);
  if (p_.chunks.empty()) p_.chunks.push_back(Chunk{0, c.n_layer, true, true});
  bool ok = p_.tp >= 1 && p_.tp_rank >= 0 && p_.tp_rank < p_.tp && c.n_head % p_.tp == 0 &&
            c.kv_heads() % p_.tp == 0 && c.ffn() % p_.tp == 0;
  int tied_holders = 0;
  for (size_t i = 0; i < p_.chunks.size(); ++i) {
    const Chunk& k = p_.chunks[i];
    ok = ok && k.first_layer >= (i ? p_.chunks[i - 1].end_layer : 0) && k.first_layer <= k.end_layer &&
         k.end_layer <= c.n_layer;
    tied_holders += k.embedding || k.head;
  }
  // One buffer holds one copy of each tensor: a tied embedding cannot sit in two chunks of it.
  if (!ok || (c.tie_embeddings && tied_holders > 1))
    throw internal_error("placement tp {} rank {} with {} chunks does not fit {}", p_.tp, p_.tp_rank,
                         p_.chunks.size(), c.describe());
  vocab_rows_ = padded_vocab(c, p_.tp) / p_.tp;
  blocks.resize(c.n_layer);
  chunk_ranges_.resize(p_.chunks.size());
  for (auto k = p_.chunks.rbegin(); k != p_.chunks.rend(); ++k) {
    const size_t begin = total_;
    if (k->head) {
      fam.add_head(*this);
      head_end = total_;
    }
    for (int l = k->end_layer - 1; l >= k->first_layer; --l) {
      blocks[l].begin = total_;
      fam.add_block(*this, l);
      blocks[l].end = total_;
    }
    fam.add_embedding(*this, *k);
    chunk_ranges_[size_t(std::distance(k, p_.chunks.rend()) - 1)] = {begin, total_};
  }
}

bool ParamLayout::whole() const {
  return p_.tp == 1 && p_.ep == 1 && p_.chunks.size() == 1 && p_.chunks[0].first_layer == 0 &&
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

double flops_per_token(const Config& c, int seq_len) { return family(c.arch).flops_per_token(c, seq_len); }

}  // namespace trn::model
