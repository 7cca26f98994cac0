#include "runtime/io/hf_config.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/io/input_file.h"

namespace trn::io {

const char* const kHfSideFiles[4] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                     "generation_config.json"};

namespace {

using json = nlohmann::json;

// Field readers: a present field of the wrong type is an error naming it; null counts as absent
// (transformers writes null for unset optional fields).
struct Reader {
  const json& j;
  const std::string& where;

  const json* get(const json& obj, const char* key) const {
    const auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  Error bad(const char* key, const json& v, const char* want) const {
    return usage_error("{}: {} is {}, not {}", where, key, v.dump(), want);
  }
  int integer(const json& obj, const char* key, int fallback, bool required = false) const {
    const json* v = get(obj, key);
    if (!v) {
      if (required) throw usage_error("{}: {} is missing; a Llama-family config.json has it", where, key);
      return fallback;
    }
    if (!v->is_number_integer() || v->get<int64_t>() < 0 ||
        v->get<int64_t>() > std::numeric_limits<int>::max())
      throw bad(key, *v, "a non-negative integer");
    return int(v->get<int64_t>());
  }
  double number(const json& obj, const char* key, double fallback) const {
    const json* v = get(obj, key);
    if (!v) return fallback;
    if (!v->is_number()) throw bad(key, *v, "a number");
    return v->get<double>();
  }
  bool boolean(const json& obj, const char* key, bool fallback) const {
    const json* v = get(obj, key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw bad(key, *v, "true or false");
    return v->get<bool>();
  }
  std::string string(const json& obj, const char* key) const {
    const json* v = get(obj, key);
    if (!v) return "";
    if (!v->is_string()) throw bad(key, *v, "a string");
    return v->get<std::string>();
  }
};

// The rope scaling object (v4 rope_scaling, v5 rope_parameters) into c. "default" (or none) is
// plain RoPE; "llama3" sets its four parameters; any other type is refused by name.
void read_rope(const Reader& r, const json& rope, const char* key, model::Config* c) {
  if (!rope.is_object()) throw r.bad(key, rope, "an object");
  std::string type = r.string(rope, "rope_type");
  if (type.empty()) type = r.string(rope, "type");  // the older spelling
  if (const json* f = r.get(rope, "partial_rotary_factor"); f && !(f->is_number() && f->get<double>() == 1.0))
    throw usage_error(
        "{}: {}.partial_rotary_factor {} is not supported; trn rotates every dimension of a head", r.where,
        key, f->dump());
  if (type.empty() || type == "default") return;
  if (type != "llama3")
    throw usage_error(
        "{}: {} type '{}' is not supported; trn implements the default RoPE and rope_type llama3", r.where,
        key, type);
  for (const char* need :
       {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
    if (!r.get(rope, need))
      throw usage_error(
          "{}: {} of type llama3 has no {}; it needs factor, low_freq_factor, high_freq_factor and "
          "original_max_position_embeddings",
          r.where, key, need);
  c->rope_factor = r.number(rope, "factor", 0);
  c->rope_low_freq_factor = r.number(rope, "low_freq_factor", 1);
  c->rope_high_freq_factor = r.number(rope, "high_freq_factor", 4);
  c->rope_original_ctx = r.integer(rope, "original_max_position_embeddings", 8192);
}

}  // namespace

HfConfig parse_hf_config(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw usage_error("{} is not valid JSON: {}", where, e.what());
  }
  if (!j.is_object()) throw usage_error("{} is not a JSON object", where);
  const Reader r{j, where};
  HfConfig out;
  out.source = text;
  model::Config& c = out.config;
  const std::string type = r.string(j, "model_type");
  if (type != "llama" && type != "qwen2" && type != "mistral")
    throw usage_error(
        "{}: model_type '{}' is not supported; trn reads llama, qwen2 and mistral (without a sliding "
        "window)",
        where, type.empty() ? "(none)" : type);
  c = model::Config{};
  c.arch = "llama";
  c.n_layer = r.integer(j, "num_hidden_layers", 0, true);
  c.n_head = r.integer(j, "num_attention_heads", 0, true);
  c.d_model = r.integer(j, "hidden_size", 0, true);
  c.ffn_dim = r.integer(j, "intermediate_size", 0, true);
  c.vocab = r.integer(j, "vocab_size", 0, true);
  c.n_kv_head = r.integer(j, "num_key_value_heads", c.n_head);
  const int max_pos = r.integer(j, "max_position_embeddings", 0, true);
  c.ctx = std::min(max_pos, kMaxHfContext);
  if (max_pos > kMaxHfContext)
    log::warn(log::Subsys::kTrain,
              "{}: max_position_embeddings {} is above trn's longest context; sequences up to {} tokens (written back "
              "as {} by --save-hf)",
              where, max_pos, kMaxHfContext, max_pos);
  c.norm_eps = r.number(j, "rms_norm_eps", 1e-6);  // transformers' default for all three
  c.tie_embeddings = r.boolean(j, "tie_word_embeddings", false);
  // An explicit head_dim that is not hidden_size / heads (Qwen3, Gemma style); equal to it, it
  // changes nothing and stays implicit, so the model describes as it did.
  if (const int hd = r.integer(j, "head_dim", 0); hd > 0 && (c.n_head == 0 || c.d_model != hd * c.n_head))
    c.head_size = hd;
  const std::string act = r.string(j, "hidden_act");
  if (!act.empty() && act != "silu")
    throw usage_error("{}: hidden_act '{}' is not supported; trn's Llama MLP is SwiGLU (silu)", where, act);
  if (type == "llama") {
    for (const char* key : {"attention_bias", "mlp_bias"})
      if (r.boolean(j, key, false))
        throw usage_error(
            "{}: {} true is not supported for model_type llama; trn's Llama linears have no biases "
            "(Qwen2's q/k/v biases come with model_type qwen2)",
            where, key);
  }
  if (type == "qwen2") {
    c.qkv_bias = true;  // Qwen2 always has q, k and v biases and no others
    if (r.boolean(j, "use_sliding_window", false))
      throw usage_error("{}: use_sliding_window true is not supported; trn's attention is full causal",
                        where);
  }
  if (type == "mistral") {
    const json* w = r.get(j, "sliding_window");
    if (w && (!w->is_number_integer() || w->get<int64_t>() < max_pos))
      throw usage_error(
          "{}: sliding_window {} is shorter than max_position_embeddings {}; trn's attention is full "
          "causal, so only a mistral without a window (null, or at least the context) loads",
          where, w->dump(), max_pos);
  }
  if (const json* lt = r.get(j, "layer_types")) {
    if (!lt->is_array()) throw r.bad("layer_types", *lt, "an array");
    for (const json& t : *lt)
      if (!(t.is_string() && t.get<std::string>() == "full_attention"))
        throw usage_error("{}: layer_types holds {}; trn's attention is full causal in every layer", where,
                          t.dump());
  }
  if (const json* f = r.get(j, "partial_rotary_factor"); f && !(f->is_number() && f->get<double>() == 1.0))
    throw usage_error("{}: partial_rotary_factor {} is not supported; trn rotates every dimension of a head",
                      where, f->dump());
  // RoPE: v5 keeps theta and the scaling in rope_parameters, v4 at the top level.
  c.rope_theta = r.number(j, "rope_theta", 10000.0);
  if (const json* p = r.get(j, "rope_parameters")) {
    c.rope_theta = r.number(*p, "rope_theta", c.rope_theta);
    read_rope(r, *p, "rope_parameters", &c);
  } else if (const json* s = r.get(j, "rope_scaling")) {
    read_rope(r, *s, "rope_scaling", &c);
  }
  out.dtype = r.string(j, "dtype");
  if (out.dtype.empty()) out.dtype = r.string(j, "torch_dtype");
  try {
    c.validate();
  } catch (const Error& e) {
    throw usage_error("{}: {}", where, e.what());
  }
  return out;
}

HfConfig read_hf_config(const std::string& dir, const std::string& flag) {
  const std::string path = dir + "/config.json";
  return parse_hf_config(read_input_file(flag + " config.json", path), path);
}

std::string hf_config_json(const model::Config& c, const std::string& torch_dtype,
                           const std::string& source) {
  json src = json::object();
  if (!source.empty()) src = json::parse(source, nullptr, false);
  if (!src.is_object()) src = json::object();
  const bool qwen = c.qkv_bias;
  json j = json::object();
  j["architectures"] = {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
  j["model_type"] = qwen ? "qwen2" : "llama";
  j["hidden_size"] = c.d_model;
  j["intermediate_size"] = c.ffn();
  j["num_hidden_layers"] = c.n_layer;
  j["num_attention_heads"] = c.n_head;
  j["num_key_value_heads"] = c.kv_heads();
  j["head_dim"] = c.head_dim();
  // The source's context when trn read it capped (kMaxHfContext).
  int ctx = c.ctx;
  if (const auto it = src.find("max_position_embeddings"); it != src.end() && it->is_number_integer() &&
                                                           c.ctx == kMaxHfContext &&
                                                           it->get<int64_t>() > kMaxHfContext)
    ctx = int(it->get<int64_t>());
  j["max_position_embeddings"] = ctx;
  j["vocab_size"] = c.vocab;
  j["rms_norm_eps"] = c.norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_factor != 0)
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_factor},
                         {"low_freq_factor", c.rope_low_freq_factor},
                         {"high_freq_factor", c.rope_high_freq_factor},
                         {"original_max_position_embeddings", c.rope_original_ctx}};
  else
    j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = c.tie_embeddings;
  j["hidden_act"] = "silu";
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  if (qwen) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = c.n_layer;
  } else {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  }
  j["torch_dtype"] = torch_dtype;
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (const auto it = src.find(key); it != src.end()) j[key] = *it;
  return j.dump(2) + "\n";
}

HfGeneration parse_hf_generation(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error("{}: not JSON: {}", where, e.what());
  }
  if (!j.is_object()) throw usage_error("{}: not a JSON object", where);
  const auto field = [&](const char* key) -> const json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  const auto id = [&](const json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > std::numeric_limits<int32_t>::max())
      throw usage_error("{}: eos_token_id holds {}, not a token id", where, v.dump());
    return int32_t(v.get<int64_t>());
  };
  const auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    const json* v = field(key);
    if (!v) return std::nullopt;
    if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < lo || v->get<double>() > hi)
      throw usage_error("{}: {} is {}, not a number from {} to {}", where, key, v->dump(), lo, hi);
    return v->get<double>();
  };
  const auto count = [&](const char* key) -> std::optional<int> {
    const json* v = field(key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > std::numeric_limits<int>::max())
      throw usage_error("{}: {} is {}, not a count", where, key, v->dump());
    return int(v->get<int64_t>());
  };
  HfGeneration g;
  if (const json* e = field("eos_token_id")) {
    if (e->is_array())
      for (const json& v : *e) g.eos.push_back(id(v));
    else
      g.eos.push_back(id(*e));
  }
  if (const json* v = field("do_sample")) {
    if (!v->is_boolean()) throw usage_error("{}: do_sample is {}, not true or false", where, v->dump());
    g.do_sample = v->get<bool>();
  }
  g.temperature = number("temperature", 0, 1e6);
  g.top_p = number("top_p", 0, 1);
  g.top_k = count("top_k");
  g.max_new_tokens = count("max_new_tokens");
  g.max_length = count("max_length");
  // Fields that change what is sampled, with the value at which they change nothing; trn names
  // any other value rather than silently sample differently.
  const std::pair<const char*, double> kUnused[] = {
      {"repetition_penalty", 1}, {"num_beams", 1}, {"typical_p", 1}, {"min_p", 0}, {"no_repeat_ngram_size", 0}};
  for (const auto& [key, neutral] : kUnused) {
    const json* v = field(key);
    if (v && !(v->is_number() && v->get<double>() == neutral))
      g.unused.push_back(fmt::format("{} {}", key, v->dump()));
  }
  return g;
}

std::optional<HfGeneration> read_hf_generation(const std::string& dir) {
  const std::string path = dir + "/generation_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  return parse_hf_generation(read_input_file("generation config", path), path);
}

}  // namespace trn::io
