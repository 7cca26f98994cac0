// Hugging Face directories through real trn-train processes: --save-hf then --init-hf gives the
// weights bit for bit at f32 in one process and at --tp 2, --pp 2 and --dp 2 --zero 3 (lr 0, so a
// step changes nothing), every layout writing the same directory byte for byte; bf16 saves the
// rounded weights; trn-generate reads the directory as it reads --save's file; bad directories
// are one usage line with nothing written; and each tp rank's peak memory while loading is a
// fraction of one process's (each reads only its slices).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>

#include "runtime/io/hf_config.h"
#include "runtime/io/hf_dir.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"
#include "runtime/model/model.h"
#include "tests/support/jobs.h"
#include "tests/support/process.h"
#include "tests/support/usage_error.h"

using namespace trn::test;
using namespace std::chrono_literals;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

ProcResult train(int n, std::vector<std::string> args) {
  args.insert(args.begin(), bin("trn-train"));
  return run_all({ProcSpec{n > 1 ? trnrun_cmd(n, args) : args, {{"TRN_LOG_LEVEL", "warn"}}}}, 300s).at(0);
}

std::vector<std::string> quick(std::vector<std::string> extra) {
  std::vector<std::string> a = {"--seq-len", "16", "--batch-size",    "4",
                                "--steps",   "1",  "--micro-batches", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Every tensor's bytes in the directory's (or file's) safetensors, by name.
std::map<std::string, std::string> tensors_of(const std::string& path) {
  std::vector<std::string> files;
  if (fs::is_directory(path)) {
    for (const auto& e : fs::directory_iterator(path))
      if (e.path().extension() == ".safetensors") files.push_back(e.path());
  } else {
    files.push_back(path);
  }
  std::map<std::string, std::string> out;
  for (const std::string& f : files) {
    trn::io::SafetensorsFile st(f);
    for (const auto& [name, t] : st.tensors()) out[name] = std::string(st.data(t), t.end - t.begin);
  }
  return out;
}

// Every file of a directory, by name.
std::map<std::string, std::string> files_of(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename()] = file_bytes(e.path());
  return out;
}

void put(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// A Llama in the --save-hf format from a short training run (several shards, tied), with a
// tokenizer and generation file beside it; and the same weights as --save's file.
struct Source {
  std::string dir, file;
};
Source make_source(const TempDir& tmp) {
  Source s{tmp.path() + "/src", tmp.path() + "/src.safetensors"};
  const auto r =
      train(1, quick({"--model", "llama-tiny", "--tie-embeddings", "1", "--steps", "2", "--save-hf", s.dir,
                      "--save-dtype", "f32", "--save-shard-size", "200KB", "--save", s.file}));
  INFO(r.describe());
  REQUIRE(r.ok());
  return s;
}

}  // namespace

TEST_CASE(
    "save-hf writes what transformers loads: sorted index with total_size, format pt, config, no tied head") {
  TempDir tmp;
  const Source s = make_source(tmp);
  const std::string index_text = file_bytes(s.dir + "/model.safetensors.index.json");
  const json index = json::parse(index_text);
  std::vector<std::string> order;  // the weight_map's keys in the order the file lists them
  const std::string map_text = index_text.substr(index_text.find("\"weight_map\""));
  const std::regex key("\n    \"([^\"]+)\":");
  for (auto it = std::sregex_iterator(map_text.begin(), map_text.end(), key); it != std::sregex_iterator();
       ++it)
    order.push_back((*it)[1]);
  REQUIRE(order.size() == index.at("weight_map").size());
  CHECK(std::is_sorted(order.begin(), order.end()));
  CHECK(!index.at("weight_map").contains("lm_head.weight"));
  uint64_t total = 0;
  std::set<std::string> shards;
  for (const auto& [name, file] : index.at("weight_map").items()) shards.insert(file.get<std::string>());
  CHECK(shards.size() > 2);
  for (const std::string& f : shards) {
    CHECK(std::regex_match(f, std::regex(R"(model-\d{5}-of-\d{5}\.safetensors)")));
    trn::io::SafetensorsFile st(s.dir + "/" + f);
    CHECK(st.metadata().at("format") == "pt");
    for (const auto& [name, t] : st.tensors()) total += t.end - t.begin;
  }
  CHECK(index.at("metadata").at("total_size") == total);
  const json cfg = json::parse(file_bytes(s.dir + "/config.json"));
  CHECK(cfg.at("model_type") == "llama");
  CHECK(cfg.at("architectures") == json::array({"LlamaForCausalLM"}));
  CHECK(cfg.at("hidden_size") == 128);
  CHECK(cfg.at("intermediate_size") == 384);
  CHECK(cfg.at("num_hidden_layers") == 2);
  CHECK(cfg.at("num_attention_heads") == 4);
  CHECK(cfg.at("num_key_value_heads") == 2);
  CHECK(cfg.at("vocab_size") == 256);
  CHECK(cfg.at("max_position_embeddings") == 128);
  CHECK(cfg.at("tie_word_embeddings") == true);
  CHECK(cfg.at("torch_dtype") == "float32");
  // The f32 directory holds exactly --save's tensors, bit for bit.
  CHECK(tensors_of(s.dir) == tensors_of(s.file));
  // trn-plan reads the shape from config.json: the same plan as the preset it was trained as.
  auto plan = [](std::vector<std::string> model) {
    model.insert(model.begin(), bin("trn-plan"));
    model.insert(model.end(), {"--seq-len", "32", "--cluster", "trn2.48xlarge:2", "--global-batch", "8"});
    const ProcResult r = run_all({ProcSpec{model, {}}}, 60s).at(0);
    INFO(r.describe());
    CHECK(r.ok());
    return std::regex_replace(r.output, std::regex(" in [0-9.]+ s"), "");
  };
  CHECK(plan({"--init-hf", s.dir}) == plan({"--model", "llama-tiny", "--tie-embeddings", "1"}));
}

TEST_CASE(
    "init-hf then save-hf at f32: bit-identical weights in one process and at tp 2, pp 2, dp 2 zero 3") {
  TempDir tmp;
  const Source s = make_source(tmp);
  // trn-generate reads the directory as it reads --save's file (same greedy continuation).
  auto generate = [](std::vector<std::string> args) {
    args.insert(args.begin(), bin("trn-generate"));
    args.insert(args.end(), {"--prompt", "ab", "--max-new-tokens", "12"});
    return run_all({ProcSpec{args, {}}}, 60s).at(0);
  };
  const auto g_file = generate({"--model", s.file});
  const auto g_dir = generate({"--init-hf", s.dir});
  INFO(g_dir.describe());
  REQUIRE(g_dir.ok());
  REQUIRE(g_file.ok());
  auto text = [](const std::string& out) { return out.substr(0, out.find("trn-generate:")); };
  CHECK(text(g_dir.output).size() > 2);
  CHECK(text(g_dir.output) == text(g_file.output));

  // A real directory's side files and config fields come through unchanged.
  put(s.dir + "/tokenizer.json", "{\"model\": {\"type\": \"BPE\"}}\n");
  put(s.dir + "/generation_config.json", "{\"eos_token_id\": [1, 2]}\n");
  json cfg = json::parse(file_bytes(s.dir + "/config.json"));
  cfg["bos_token_id"] = 1;
  cfg["eos_token_id"] = 2;
  put(s.dir + "/config.json", cfg.dump());

  const std::map<std::string, std::string> want = tensors_of(s.file);
  std::map<std::string, std::string> first_out;
  const std::vector<std::pair<int, std::vector<std::string>>> layouts = {
      {1, {}}, {2, {"--tp", "2"}}, {2, {"--pp", "2"}}, {2, {"--dp", "2", "--zero", "3"}}};
  for (const auto& [n, layout] : layouts) {
    const std::string name = n == 1 ? "one" : fmt::format("{}", fmt::join(layout, "_"));
    const std::string out = tmp.path() + "/" + name, file = tmp.path() + "/" + name + ".safetensors";
    std::vector<std::string> args = quick({"--init-hf", s.dir, "--lr", "0", "--save-hf", out, "--save-dtype",
                                           "f32", "--save-shard-size", "200KB", "--save", file});
    args.insert(args.end(), layout.begin(), layout.end());
    const auto r = train(n, args);
    INFO(name << ": " << r.describe());
    REQUIRE(r.ok());
    CHECK(tensors_of(file) == want);
    CHECK(tensors_of(out) == want);
    const auto files = files_of(out);
    CHECK(files.at("tokenizer.json") == file_bytes(s.dir + "/tokenizer.json"));
    CHECK(files.at("generation_config.json") == file_bytes(s.dir + "/generation_config.json"));
    const json c = json::parse(files.at("config.json"));
    CHECK(c.at("bos_token_id") == 1);
    CHECK(c.at("eos_token_id") == 2);
    if (first_out.empty())
      first_out = files;
    else
      CHECK(files == first_out);  // every layout writes the same directory, byte for byte
  }

  // bf16 (the default): the weights rounded to nearest even.
  const std::string bf = tmp.path() + "/bf16";
  const auto r = train(1, quick({"--init-hf", s.dir, "--lr", "0", "--save-hf", bf}));
  INFO(r.describe());
  REQUIRE(r.ok());
  CHECK(json::parse(file_bytes(bf + "/config.json")).at("torch_dtype") == "bfloat16");
  const auto got = tensors_of(bf);
  REQUIRE(got.size() == want.size());
  for (const auto& [name, bytes] : want) {
    std::string rounded(bytes.size() / 2, '\0');
    for (size_t i = 0; i < bytes.size() / 4; ++i) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      const uint16_t h = trn::kernels::to_bf16(f);
      std::memcpy(&rounded[2 * i], &h, 2);
    }
    CHECK(got.at(name) == rounded);
  }
}

TEST_CASE("bad Hugging Face directories are one usage line, and nothing is written") {
  TempDir tmp;
  const Source s = make_source(tmp);
  auto variant = [&](const std::string& name, const std::function<void(const std::string&)>& edit) {
    const std::string d = tmp.path() + "/" + name;
    fs::copy(s.dir, d);
    edit(d);
    return d;
  };
  auto edit_config = [](const std::string& d, const std::function<void(json&)>& f) {
    json c = json::parse(file_bytes(d + "/config.json"));
    f(c);
    put(d + "/config.json", c.dump());
  };
  const std::string out = tmp.path() + "/out";
  auto refused = [&](const std::string& dir, const std::vector<std::string>& phrases) {
    expect_usage_error(train(1, quick({"--init-hf", dir, "--save-hf", out})), phrases);
    CHECK(!fs::exists(out));
  };
  std::set<std::string> shards;
  const json index = json::parse(file_bytes(s.dir + "/model.safetensors.index.json"));
  for (const auto& [k, v] : index.at("weight_map").items()) shards.insert(v.get<std::string>());
  const std::string second = *std::next(shards.begin());
  refused(variant("missing", [&](const std::string& d) { fs::remove(d + "/" + second); }),
          {"--init-hf", "shard " + second + " is missing"});
  refused(
      variant("shape",
              [&](const std::string& d) { edit_config(d, [](json& c) { c["intermediate_size"] = 256; }); }),
      {"model.layers.0.mlp.up_proj.weight has shape [384, 128] but config.json gives the model [256, 128]"});
  refused(variant("gemma",
                  [&](const std::string& d) { edit_config(d, [](json& c) { c["model_type"] = "gemma"; }); }),
          {"config.json: model_type 'gemma' is not supported"});
  refused(
      variant("yarn",
              [&](const std::string& d) {
                edit_config(d, [](json& c) { c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; });
              }),
      {"config.json: rope_scaling type 'yarn' is not supported"});
  // An output directory that holds something else is refused before any step.
  fs::create_directory(out);
  put(out + "/notes.txt", "mine");
  expect_usage_error(train(1, quick({"--init-hf", s.dir, "--save-hf", out})), {"already holds notes.txt"});
  expect_usage_error(train(1, quick({"--init-hf", s.dir, "--model", "llama-tiny"})),
                     {"takes the model from its config.json; drop --model"});
  expect_usage_error(train(1, quick({"--model", "tiny", "--save-hf", tmp.path() + "/gpt2"})),
                     {"--save-hf writes Llama-family directories", "not a gpt2 model"});
}

// A Llama-3.2-1B-shaped model (ratios of layers, heads, widths and vocabulary), bf16, written by
// save_hf; the shape from args: n_layer n_head n_kv_head d_model ffn vocab.
TRN_TEST_CHILD(hf_write_llama) {
  trn::model::Config c;
  c.arch = "llama";
  c.n_layer = std::stoi(args.at(1));
  c.n_head = std::stoi(args.at(2));
  c.n_kv_head = std::stoi(args.at(3));
  c.d_model = std::stoi(args.at(4));
  c.ffn_dim = std::stoi(args.at(5));
  c.vocab = std::stoi(args.at(6));
  c.ctx = 8192;
  c.rope_theta = 500000;
  c.tie_embeddings = true;
  const trn::model::ParamLayout whole(c);
  std::vector<float> p(whole.total());
  trn::model::init_params(whole, 1, p.data());
  trn::io::save_hf(args.at(0), whole, p.data(), trn::io::HfSave{});
  return 0;
}

// Loads DIR as tp rank R of T (args: DIR T R) and prints this process's peak RSS in bytes.
TRN_TEST_CHILD(hf_load_rss) {
  const trn::model::Config c = trn::io::read_hf_config(args.at(0)).config;
  const trn::model::ParamLayout lay(c,
                                    trn::model::Placement{std::stoi(args.at(1)), std::stoi(args.at(2)), {}});
  std::vector<float> p(lay.total());
  const auto t0 = std::chrono::steady_clock::now();
  trn::io::load_hf(args.at(0), lay, p.data());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("peak_rss=%llu params=%zu load_s=%.2f\n",
              static_cast<unsigned long long>(trn::io::peak_rss_bytes()), lay.total(), s);
  return 0;
}

TEST_CASE("at tp 2 each rank's peak memory while loading is at most 60% of one process's") {
  TempDir tmp;
  const std::string dir = tmp.path() + "/m";
  // Llama-3.2-1B / 4 in width (16 layers, 8 heads of 64, 2 KV heads, ffn 4x, vocab 62.6x d_model).
  const auto w =
      run_all({child("hf_write_llama", {dir, "16", "8", "2", "512", "2048", "32064"})}, 300s).at(0);
  INFO(w.describe());
  REQUIRE(w.ok());
  auto rss = [](const ProcResult& r) {
    INFO(r.describe());
    REQUIRE(r.ok());
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex("peak_rss=(\\d+)")));
    return std::stod(m[1]);
  };
  const double one = rss(run_all({child("hf_load_rss", {dir, "1", "0"})}, 300s).at(0));
  const auto ranks =
      run_all({child("hf_load_rss", {dir, "2", "0"}), child("hf_load_rss", {dir, "2", "1"})}, 300s);
  for (const auto& r : ranks) {
    const double mine = rss(r);
    INFO("tp rank peak " << mine / 1e6 << " MB, one process " << one / 1e6 << " MB");
    CHECK(mine <= 0.6 * one);
  }
}
