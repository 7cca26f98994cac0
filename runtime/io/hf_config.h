// A Hugging Face model directory's config.json, in and out (docs/huggingface.md).
//
// Read: both of transformers' spellings, v4's (rope_theta and rope_scaling at the top level,
// torch_dtype) and v5's (rope_parameters holding rope_theta and the scaling, dtype). model_type
// llama, qwen2 (q/k/v biases) and mistral without a sliding window become trn's arch "llama";
// anything trn does not compute is refused by name in one usage line rather than loaded as a
// different model.
// Write: the v4 spelling, which transformers 4.x and 5.x both read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "runtime/model/config.h"

namespace trn::io {

// The largest context trn builds (Config::validate); a longer max_position_embeddings is read as
// this one (the Llama family has no position table, so only the longest sequence changes) and
// written back as the source's value.
constexpr int kMaxHfContext = 1 << 17;

struct HfConfig {
  model::Config config;
  std::string dtype;   // torch_dtype / dtype as written ("bfloat16", "float32", ...; empty: absent)
  std::string source;  // config.json's text, for write_hf_config to copy token ids and the context from
};

// DIR/config.json parsed. Usage errors name `flag`, the file and the field.
HfConfig read_hf_config(const std::string& dir, const std::string& flag = "--init-hf");
// The same from config.json's text; `where` names it in errors.
HfConfig parse_hf_config(const std::string& text, const std::string& where);

// config.json's text for c in the v4 spelling: model_type llama (qwen2 when c.qkv_bias), the
// architectures entry, torch_dtype ("bfloat16" or "float32"), llama3 rope_scaling when c has it;
// bos/eos/pad token ids and a context longer than trn's from `source` (a config.json text, may be
// empty).
std::string hf_config_json(const model::Config& c, const std::string& torch_dtype, const std::string& source);

// The files of a Hugging Face directory trn copies unchanged from the --init-hf directory into a
// --save-hf one (tokenizer, chat template, generation defaults).
extern const char* const kHfSideFiles[4];

// generation_config.json: the defaults transformers' generate() takes for the model. Each field
// is set only when the file has it (null counts as absent).
struct HfGeneration {
  std::vector<int32_t> eos;  // eos_token_id: one id or a list; generation stops at any of them
  std::optional<bool> do_sample;
  std::optional<double> temperature, top_p;
  std::optional<int> top_k, max_new_tokens, max_length;
  std::vector<std::string> unused;  // fields that change sampling and trn does not apply (repetition_penalty, ...)
};

// DIR/generation_config.json, or nullopt when DIR has none. Usage errors, one line naming the file
// and the field, for one that is not JSON or a field of the wrong type or range.
std::optional<HfGeneration> read_hf_generation(const std::string& dir);
// The same from the file's text; `where` names it in errors.
HfGeneration parse_hf_generation(const std::string& text, const std::string& where);

}  // namespace trn::io
