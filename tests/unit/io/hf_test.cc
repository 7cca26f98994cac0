// Hugging Face directories in one process (runtime/io/hf_config.h, hf_dir.h): config.json in
// transformers' v4 and v5 spellings and what is refused; save_hf's files (shards, index, metadata,
// no tied head) and load_hf's slices at any placement, bit for bit at f32 and rounded at bf16;
// F16 read; a missing shard, a disagreeing shape, an unknown tensor, each one usage error; a
// failed save (full disk) leaves nothing.
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "collectives/core/error.h"
#include "runtime/io/hf_config.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"
#include "runtime/model/model.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"

using namespace trn;
using namespace trn::test;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Llama-3.2-1B's config.json as transformers 4.45 writes it, with small dimensions.
json llama32_v4() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 96})");
}

// The same in transformers 5's spelling: rope_parameters holds theta and the scaling, dtype.
json llama32_v5() {
  json j = llama32_v4();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";
  j["rope_parameters"] = {{"rope_type", "llama3"},   {"rope_theta", 500000.0},
                          {"factor", 32.0},          {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  return j;
}

json qwen25() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 96, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 80})");
}

std::string refusal(const json& j) {
  try {
    io::parse_hf_config(j.dump(), "config.json");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  return "accepted";
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  return "accepted";
}

// A tiny Llama with random weights, whole, and its buffer.
model::Config tiny(bool tied) {
  model::Config c = io::parse_hf_config(llama32_v4().dump(), "config.json").config;
  c.tie_embeddings = tied;
  c.ctx = 64;
  return c;
}

std::vector<float> random_params(const model::ParamLayout& lay, uint64_t seed = 7) {
  std::vector<float> p(lay.total());
  model::init_params(lay, seed, p.data());
  // Norm weights start at one; spread them so a wrong copy shows.
  for (size_t i = 0; i < p.size(); ++i) p[i] += 1e-3f * float(i % 97);
  return p;
}

// A safetensors file by hand: tensors given as (name, dtype, shape, bytes), in that order.
struct RawTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
void write_raw(const std::string& path, const std::vector<RawTensor>& ts) {
  json h = json::object();
  size_t at = 0;
  std::string data;
  for (const auto& t : ts) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
    data += t.bytes;
  }
  const std::string hs = h.dump();
  std::string out(8, '\0');
  const uint64_t n = hs.size();
  std::memcpy(out.data(), &n, 8);
  std::ofstream(path, std::ios::binary) << out << hs << data;
}

void put(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

}  // namespace

TEST_CASE(
    "config.json: Llama-3.2 in the v4 and v5 spellings gives one Config, llama3 rope scaling included") {
  const io::HfConfig v4 = io::parse_hf_config(llama32_v4().dump(), "config.json");
  const io::HfConfig v5 = io::parse_hf_config(llama32_v5().dump(), "config.json");
  const model::Config& c = v4.config;
  CHECK(c.arch == "llama");
  CHECK(c.n_layer == 2);
  CHECK(c.n_head == 4);
  CHECK(c.kv_heads() == 2);
  CHECK(c.d_model == 64);
  CHECK(c.ffn() == 128);
  CHECK(c.vocab == 96);
  CHECK(c.ctx == 131072);
  CHECK(c.rope_theta == 500000.0);
  CHECK(c.norm_eps == 1e-5);
  CHECK(c.tie_embeddings);
  CHECK(c.head_size == 0);  // 16 = 64 / 4: implicit
  CHECK(c.rope_factor == 32.0);
  CHECK(c.rope_low_freq_factor == 1.0);
  CHECK(c.rope_high_freq_factor == 4.0);
  CHECK(c.rope_original_ctx == 8192);
  CHECK(!c.qkv_bias);
  CHECK(v4.dtype == "bfloat16");
  CHECK(v5.dtype == "bfloat16");
  CHECK(v5.config.describe() == c.describe());
  // No scaling: rope_scaling null (v4) or rope_type default (v5).
  json plain = llama32_v4();
  plain["rope_scaling"] = nullptr;
  CHECK(io::parse_hf_config(plain.dump(), "c").config.rope_factor == 0);
  json plain5 = llama32_v5();
  plain5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  CHECK(io::parse_hf_config(plain5.dump(), "c").config.rope_factor == 0);
  CHECK(io::parse_hf_config(plain5.dump(), "c").config.rope_theta == 10000.0);
  // An explicit head_dim that differs from hidden_size / heads.
  json wide = llama32_v4();
  wide["head_dim"] = 32;
  CHECK(io::parse_hf_config(wide.dump(), "c").config.head_dim() == 32);
  // A context beyond trn's largest is read as that.
  json longer = llama32_v4();
  longer["max_position_embeddings"] = 1 << 20;
  CHECK(io::parse_hf_config(longer.dump(), "c").config.ctx == io::kMaxHfContext);
}

TEST_CASE("config.json: Qwen2.5 has q/k/v biases and tied embeddings; mistral only without a window") {
  const model::Config q = io::parse_hf_config(qwen25().dump(), "config.json").config;
  CHECK(q.arch == "llama");
  CHECK(q.qkv_bias);
  CHECK(q.tie_embeddings);
  CHECK(q.rope_theta == 1e6);
  CHECK(q.norm_eps == 1e-6);
  CHECK(q.ffn() == 96);
  json mistral = llama32_v4();
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = nullptr;
  CHECK(io::parse_hf_config(mistral.dump(), "c").config.arch == "llama");
  mistral["sliding_window"] = 131072;
  CHECK(io::parse_hf_config(mistral.dump(), "c").config.arch == "llama");
  mistral["sliding_window"] = 4096;
  CHECK_THAT(refusal(mistral),
             Catch::Contains("sliding_window 4096 is shorter than max_position_embeddings 131072"));
}

TEST_CASE("config.json: what trn does not compute is refused by name") {
  auto with = [](const char* key, json v, json base = llama32_v4()) {
    base[key] = v;
    return refusal(base);
  };
  CHECK_THAT(with("model_type", "gemma2"), Catch::Contains("model_type 'gemma2' is not supported"));
  CHECK_THAT(with("attention_bias", true), Catch::Contains("attention_bias true is not supported"));
  CHECK_THAT(with("mlp_bias", true), Catch::Contains("mlp_bias true is not supported"));
  CHECK_THAT(with("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}),
             Catch::Contains("rope_scaling type 'yarn' is not supported"));
  CHECK_THAT(with("rope_scaling", {{"type", "linear"}, {"factor", 2.0}}),
             Catch::Contains("rope_scaling type 'linear' is not supported"));
  json v5 = llama32_v5();
  v5["rope_parameters"]["rope_type"] = "dynamic";
  CHECK_THAT(refusal(v5), Catch::Contains("rope_parameters type 'dynamic' is not supported"));
  CHECK_THAT(with("partial_rotary_factor", 0.5),
             Catch::Contains("partial_rotary_factor 0.5 is not supported"));
  CHECK_THAT(with("use_sliding_window", true, qwen25()), Catch::Contains("use_sliding_window true"));
  CHECK_THAT(with("layer_types", {"full_attention", "sliding_attention"}),
             Catch::Contains("layer_types holds \"sliding_attention\""));
  CHECK_THAT(with("hidden_act", "gelu"), Catch::Contains("hidden_act 'gelu' is not supported"));
  CHECK_THAT(with("num_hidden_layers", "two"),
             Catch::Contains("num_hidden_layers is \"two\", not a non-negative"));
  json none = llama32_v4();
  none.erase("hidden_size");
  CHECK_THAT(refusal(none), Catch::Contains("hidden_size is missing"));
  CHECK_THAT(refusal(json::array()), Catch::Contains("not a JSON object"));
  // Shape rules of the family, named with the file.
  CHECK_THAT(with("num_key_value_heads", 3),
             Catch::Contains("config.json: --n-kv-head 3 must divide --n-head 4"));
}

TEST_CASE("config.json written back (v4) reads as the same model, with the source's token ids and context") {
  for (const json& src : {llama32_v4(), llama32_v5(), qwen25()}) {
    const io::HfConfig in = io::parse_hf_config(src.dump(), "config.json");
    const std::string out = io::hf_config_json(in.config, "float32", in.source);
    const json j = json::parse(out);
    CHECK(j.at("torch_dtype") == "float32");
    CHECK(!j.contains("rope_parameters"));
    CHECK(j.at("bos_token_id") == src.at("bos_token_id"));
    CHECK(j.at("eos_token_id") == src.at("eos_token_id"));
    CHECK(j.at("model_type") == (in.config.qkv_bias ? "qwen2" : "llama"));
    CHECK(j.at("architectures")[0] == (in.config.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"));
    CHECK(io::parse_hf_config(out, "again").config.describe() == in.config.describe());
  }
  json longer = llama32_v4();
  longer["max_position_embeddings"] = 1 << 20;
  const io::HfConfig in = io::parse_hf_config(longer.dump(), "c");
  CHECK(json::parse(io::hf_config_json(in.config, "bfloat16", in.source)).at("max_position_embeddings") ==
        (1 << 20));
}

TEST_CASE("save_hf at f32 then load_hf gives the weights bit for bit, whole and in every tp and pp slice") {
  TempDir tmp;
  for (bool tied : {true, false}) {
    const model::Config c = tiny(tied);
    const model::ParamLayout whole(c);
    const std::vector<float> p = random_params(whole);
    const std::string dir = tmp.path() + (tied ? "/tied" : "/untied");
    io::HfSave opt;
    opt.bf16 = false;
    opt.shard_bytes = 20000;  // several shards
    opt.metadata = {{"trn.model", c.describe()}};
    io::save_hf(dir, whole, p.data(), opt);

    // The files: shards named as transformers names them, an index with sorted keys and the
    // total size, format pt in every file, no lm_head when tied.
    const std::string index_text = file_bytes(dir + "/model.safetensors.index.json");
    const json index = json::parse(index_text);
    const json& wm = index.at("weight_map");
    std::vector<std::string> keys_in_text;
    for (size_t at = index_text.find("\"weight_map\"");
         (at = index_text.find("\n    \"", at)) != std::string::npos;) {
      at += 6;
      keys_in_text.push_back(index_text.substr(at, index_text.find('"', at) - at));
    }
    REQUIRE(keys_in_text.size() == wm.size());
    CHECK(std::is_sorted(keys_in_text.begin(), keys_in_text.end()));
    CHECK(wm.contains("lm_head.weight") == !tied);
    CHECK(wm.size() == whole.tensors().size());
    std::set<std::string> files;
    for (const auto& [k, v] : wm.items()) files.insert(v.get<std::string>());
    REQUIRE(files.size() > 2);
    const std::string last = fmt::format("model-{:05d}-of-{:05d}.safetensors", files.size(), files.size());
    CHECK(files.count("model-00001-of-" + last.substr(15)) == 1);
    CHECK(files.count(last) == 1);
    uint64_t total = 0;
    for (const std::string& f : files) {
      io::SafetensorsFile st(dir + "/" + f);
      CHECK(st.metadata().at("format") == "pt");
      CHECK(st.metadata().at("trn.model") == c.describe());
      for (const auto& [name, t] : st.tensors()) {
        CHECK(t.dtype == "F32");
        CHECK(wm.at(name) == f);
        total += t.end - t.begin;
      }
    }
    CHECK(index.at("metadata").at("total_size") == total);
    CHECK(total == whole.total() * 4);
    const json cfg = json::parse(file_bytes(dir + "/config.json"));
    CHECK(cfg.at("tie_word_embeddings") == tied);
    CHECK(cfg.at("torch_dtype") == "float32");
    CHECK(cfg.at("rope_scaling").at("rope_type") == "llama3");
    CHECK(cfg.at("rope_scaling").at("factor") == 32.0);

    std::vector<float> back(whole.total(), -1.0f);
    io::load_hf(dir, whole, back.data());
    CHECK(std::memcmp(back.data(), p.data(), p.size() * 4) == 0);
    // Each slice of tp 2 and of two pipeline stages, as copy_from_global cuts it.
    for (int tp_rank : {0, 1})
      for (int stage : {0, 1}) {
        model::Placement pl{2, tp_rank, {{stage, stage + 1, stage == 0, stage == 1}}};
        const model::ParamLayout part(c, pl);
        std::vector<float> got(part.total(), -1.0f), want(part.total());
        io::load_hf(dir, part, got.data());
        for (const auto& t : part.tensors())
          model::copy_from_global(t, p.data() + whole.find(t.name).offset, want.data() + t.offset);
        CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
      }
  }
}

TEST_CASE("save_hf at bf16 rounds to nearest even; one file is model.safetensors; F16 loads exactly") {
  TempDir tmp;
  const model::Config c = tiny(true);
  const model::ParamLayout whole(c);
  std::vector<float> p = random_params(whole);
  p[0] = 1.0f + 1.0f / 256;  // halfway between two bf16 values: rounds to the even one, 1
  p[1] = 1.0f + 3.0f / 256;  // halfway: rounds up to the even one, 1 + 4/256
  const std::string dir = tmp.path() + "/bf16";
  io::save_hf(dir, whole, p.data(), io::HfSave{});
  CHECK(fs::exists(dir + "/model.safetensors"));
  CHECK(!fs::exists(dir + "/model.safetensors.index.json"));
  CHECK(json::parse(file_bytes(dir + "/config.json")).at("torch_dtype") == "bfloat16");
  std::vector<float> back(whole.total());
  io::load_hf(dir, whole, back.data());
  for (size_t i = 0; i < p.size(); ++i)
    if (back[i] != kernels::from_bf16(kernels::to_bf16(p[i]))) FAIL("element " << i);
  CHECK(kernels::from_bf16(kernels::to_bf16(1.0f + 1.0f / 256)) == 1.0f);
  CHECK(kernels::from_bf16(kernels::to_bf16(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);

  // F16: a one-tensor-per-file model by hand, every value exactly representable.
  const std::string f16 = tmp.path() + "/f16";
  fs::create_directory(f16);
  put(f16 + "/config.json", io::hf_config_json(c, "float16", ""));
  std::vector<RawTensor> ts;
  std::vector<float> want(whole.total());
  for (const auto& t : whole.tensors()) {
    std::string bytes(t.numel * 2, '\0');
    for (size_t i = 0; i < t.numel; ++i) {
      // sign, exponents from subnormal (2^-24) to 2^3, all mantissas' low bits
      const uint16_t h = uint16_t(((i & 1) << 15) | ((i * 7 % 19) << 10) | (i * 37 % 1024));
      std::memcpy(&bytes[2 * i], &h, 2);
      const int exp = int(h >> 10) & 0x1f, man = h & 0x3ff;
      const double v = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
      want[t.offset + i] = float(h & 0x8000 ? -v : v);
    }
    ts.push_back({t.name, "F16", t.global_shape, bytes});
  }
  write_raw(f16 + "/model.safetensors", ts);
  std::vector<float> got(whole.total());
  io::load_hf(f16, whole, got.data());
  CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
}

TEST_CASE("bad directories are one usage error naming the file and the tensor") {
  TempDir tmp;
  const model::Config c = tiny(false);
  const model::ParamLayout whole(c);
  const std::vector<float> p = random_params(whole);
  const std::string good = tmp.path() + "/good";
  io::HfSave opt;
  opt.shard_bytes = 20000;
  io::save_hf(good, whole, p.data(), opt);
  std::vector<float> buf(whole.total());
  std::set<std::string> files;
  const json good_index = json::parse(file_bytes(good + "/model.safetensors.index.json"));
  for (const auto& [k, v] : good_index.at("weight_map").items()) files.insert(v.get<std::string>());
  REQUIRE(files.size() > 2);
  const std::string first = *files.begin(), second = *std::next(files.begin());
  auto copy = [&](const std::string& name) {
    const std::string d = tmp.path() + "/" + name;
    fs::copy(good, d);
    return d;
  };
  const std::string missing = copy("missing");
  fs::remove(missing + "/" + second);
  CHECK_THAT(error_of([&] { io::load_hf(missing, whole, buf.data()); }),
             Catch::Contains("shard " + second + " is missing"));
  // A model whose config disagrees with the weights: a wider MLP.
  model::Config wider = c;
  wider.ffn_dim = 160;
  // Each model its own buffer: a load that fails part way has written into it.
  auto load_as = [&](const model::Config& as) {
    const model::ParamLayout lay(as);
    std::vector<float> mine(lay.total());
    io::load_hf(good, lay, mine.data());
  };
  CHECK_THAT(
      error_of([&] { load_as(wider); }),
      Catch::Contains("tensor model.layers.0.mlp.up_proj.weight has shape [128, 64] but config.json gives "
                      "the model [160, 64]"));
  // A tensor the model does not have, and one it lacks.
  model::Config tied = c;
  tied.tie_embeddings = true;
  CHECK(error_of([&] { load_as(tied); }) == "accepted");  // lm_head ignored
  model::Config shallower = c;
  shallower.n_layer = 1;
  CHECK_THAT(error_of([&] { load_as(shallower); }),
             Catch::Contains("tensor model.layers.1.input_layernorm.weight is not a parameter"));
  model::Config deeper = c;
  deeper.n_layer = 3;
  CHECK_THAT(error_of([&] { load_as(deeper); }),
             Catch::Contains("tensor model.layers.2.input_layernorm.weight is missing"));
  // An index that names a tensor its shard does not hold.
  const std::string lying = copy("lying");
  json index = json::parse(file_bytes(lying + "/model.safetensors.index.json"));
  index["weight_map"]["model.norm.weight"] = first;
  put(lying + "/model.safetensors.index.json", index.dump());
  CHECK_THAT(error_of([&] { io::load_hf(lying, whole, buf.data()); }),
             Catch::Contains("says shard " + first + " holds tensor model.norm.weight"));
  CHECK_THAT(error_of([&] { io::load_hf(tmp.path() + "/none", whole, buf.data()); }),
             Catch::Contains("cannot read"));
  fs::create_directory(tmp.path() + "/empty");
  CHECK_THAT(error_of([&] { io::load_hf(tmp.path() + "/empty", whole, buf.data()); }),
             Catch::Contains("holds neither model.safetensors nor model.safetensors.index.json"));
  // An integer tensor.
  const std::string ints = tmp.path() + "/ints";
  fs::create_directory(ints);
  write_raw(ints + "/model.safetensors",
            {{"model.embed_tokens.weight", "I16", {96, 64}, std::string(96 * 64 * 2, '\0')}});
  CHECK_THAT(error_of([&] { io::load_hf(ints, whole, buf.data()); }),
             Catch::Contains("tensor model.embed_tokens.weight has dtype I16; trn reads F32, BF16 and F16"));
}

TEST_CASE("save_hf output: a previous output is replaced whole, anything else refused") {
  TempDir tmp;
  const model::Config c = tiny(true);
  const model::ParamLayout whole(c);
  const std::vector<float> p = random_params(whole);
  const std::string dir = tmp.path() + "/out";
  io::HfSave opt;
  opt.shard_bytes = 20000;
  io::save_hf(dir, whole, p.data(), opt);
  const size_t shards =
      json::parse(file_bytes(dir + "/model.safetensors.index.json")).at("weight_map").size();
  CHECK(shards > 0);
  opt.shard_bytes = 5000000000;  // now one file: the old shards and index must go
  io::save_hf(dir, whole, p.data(), opt);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"config.json", "model.safetensors"});
  for (const auto& e : fs::directory_iterator(tmp.path()))
    CHECK(e.path().filename() == "out");  // no leftovers
  put(dir + "/notes.txt", "mine");
  CHECK_THAT(
      error_of([&] { io::check_hf_output("--save-hf", dir); }),
      Catch::Contains("--save-hf " + dir + " already holds notes.txt, which --save-hf does not write"));
  CHECK_THAT(error_of([&] { io::check_hf_output("--save-hf", tmp.path() + "/no/such"); }),
             Catch::Contains("does not exist"));
  CHECK(io::parse_byte_size("f", "5GB") == 5000000000u);
  CHECK(io::parse_byte_size("f", "2GiB") == 2147483648u);
  CHECK(io::parse_byte_size("f", "500kb") == 500000u);
  CHECK(io::parse_byte_size("f", "123") == 123u);
  CHECK_THAT(error_of([&] { io::parse_byte_size("--save-shard-size", "5 parsecs"); }),
             Catch::Contains("--save-shard-size takes a size such as 5GB"));
}

// A save that runs out of room (a file-size limit stands in for a full disk) leaves neither the
// destination nor its temporary sibling.
TRN_TEST_CHILD(save_hf_full_disk) {
  signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of killing the process
  const rlimit lim{30000, 30000};
  setrlimit(RLIMIT_FSIZE, &lim);
  const model::Config c = tiny(true);
  const model::ParamLayout whole(c);
  const std::vector<float> p = random_params(whole);
  try {
    io::save_hf(args.at(0), whole, p.data(), io::HfSave{});
  } catch (const Error& e) {
    std::printf("%s\n", e.what());
    return 2;
  }
  return 0;
}

TEST_CASE("a save that fails part way (full disk) leaves nothing behind, and an earlier output intact") {
  TempDir tmp;
  const std::string dir = tmp.path() + "/out";
  const auto r = run_all({child("save_hf_full_disk", {dir})}, std::chrono::seconds(60)).at(0);
  INFO(r.describe());
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output,
             Catch::Contains("cannot write --save-hf " + dir + ": write of model.safetensors failed"));
  CHECK(fs::is_empty(tmp.path()));
  // Over a previous output: it stays as it was.
  const model::Config c = tiny(true);
  const model::ParamLayout whole(c);
  const std::vector<float> p = random_params(whole, 9);
  io::HfSave f32;
  f32.bf16 = false;
  f32.shard_bytes = 1000;
  io::save_hf(dir, whole, p.data(), f32);
  const std::string before = file_bytes(dir + "/model.safetensors.index.json");
  const auto again = run_all({child("save_hf_full_disk", {dir})}, std::chrono::seconds(60)).at(0);
  CHECK(again.exit_code == 2);
  CHECK(file_bytes(dir + "/model.safetensors.index.json") == before);
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) entries += e.path().filename() == "out" ? 1 : 100;
  CHECK(entries == 1);
}

TEST_CASE("generation_config.json: eos ids as an int or a list, the sampling fields, and what trn does not apply") {
  const auto llama = io::parse_hf_generation(
      R"({"bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6,
          "top_p": 0.9, "transformers_version": "4.45.0"})",
      "g.json");
  CHECK(llama.eos == std::vector<int32_t>{128001, 128008, 128009});
  CHECK(llama.do_sample == true);
  CHECK(llama.temperature == 0.6);
  CHECK(llama.top_p == 0.9);
  CHECK_FALSE(llama.top_k.has_value());
  CHECK(llama.unused.empty());
  const auto qwen = io::parse_hf_generation(
      R"({"eos_token_id": 151645, "repetition_penalty": 1.1, "top_k": 20, "max_length": null, "num_beams": 1})",
      "g.json");
  CHECK(qwen.eos == std::vector<int32_t>{151645});
  CHECK(qwen.top_k == 20);
  CHECK_FALSE(qwen.max_length.has_value());  // null is absent
  CHECK(qwen.unused == std::vector<std::string>{"repetition_penalty 1.1"});
  const auto refused = [](const std::string& text) {
    try {
      io::parse_hf_generation(text, "g.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(refused(R"({"eos_token_id": [1, -2]})"), Catch::Contains("g.json: eos_token_id holds -2"));
  CHECK_THAT(refused(R"({"do_sample": "yes"})"), Catch::Contains("do_sample"));
  CHECK_THAT(refused(R"({"temperature": -1})"), Catch::Contains("temperature is -1"));
  CHECK_THAT(refused(R"({"max_new_tokens": 1.5})"), Catch::Contains("max_new_tokens is 1.5"));
  CHECK_THAT(refused("[]"), Catch::Contains("not a JSON object"));
}
