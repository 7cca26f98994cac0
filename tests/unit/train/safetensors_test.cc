#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>

#include "collectives/core/error.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/one_stage.h"
#include "tests/support/process.h"

using namespace trn;

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
std::string load_error(const std::string& path, const model::Config& c) {
  model::ParamLayout lay(c);
  std::vector<float> p(lay.total());
  try {
    io::load_gpt2(path, lay, p.data());
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  FAIL("loaded without error");
  return "";
}
// A header by hand: 8-byte length + JSON, then `data` bytes.
std::string file_with_header(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\0');
}

const model::Config kCfg{2, 2, 8, 6, 11};

}  // namespace

TEST_CASE("safetensors round trip with Hugging Face names and shapes") {
  test::TempDir dir;
  model::OneStageModel m(kCfg, 1, 4, 1);
  m.init(9);
  const std::string path = dir.path() + "/w.safetensors";
  io::save_gpt2(path, m.layout(), m.params(), {{"note", "x\"y"}});
  io::SafetensorsFile f(path);
  CHECK(f.tensors().size() == m.layout().tensors().size());
  CHECK(f.metadata().at("note") == "x\"y");
  const auto& fc = f.tensors().at("h.1.mlp.c_fc.weight");
  CHECK(fc.dtype == "F32");
  CHECK(fc.shape == std::vector<int64_t>{8, 32});
  CHECK(f.tensors().at("h.0.attn.c_attn.bias").shape == std::vector<int64_t>{24});
  CHECK(f.tensors().at("wpe.weight").shape == std::vector<int64_t>{6, 8});
  const std::string bytes = read(path);
  uint64_t hlen;
  std::memcpy(&hlen, bytes.data(), 8);
  CHECK((8 + hlen) % 8 == 0);  // data aligned
  model::OneStageModel back(kCfg, 1, 4, 1);
  io::load_gpt2(path, back.layout(), back.params());
  CHECK(std::memcmp(back.params(), m.params(), m.num_params() * sizeof(float)) == 0);
}

TEST_CASE("a checkpoint of another shape or dtype is an error naming the tensor") {
  test::TempDir dir;
  model::OneStageModel m(kCfg, 1, 4, 1);
  const std::string path = dir.path() + "/w.safetensors";
  io::save_gpt2(path, m.layout(), m.params());
  model::Config wider = kCfg;
  wider.d_model = 16;
  CHECK_THAT(load_error(path, wider), Catch::Contains("wte.weight") && Catch::Contains("[11, 8]") &&
                                          Catch::Contains("[11, 16]"));
  model::Config deeper = kCfg;
  deeper.n_layer = 3;
  CHECK_THAT(load_error(path, deeper), Catch::Contains("h.2.") && Catch::Contains("missing"));
  model::Config shallower = kCfg;
  shallower.n_layer = 1;
  CHECK_THAT(load_error(path, shallower), Catch::Contains("h.1.") && Catch::Contains("not a parameter"));
  // A well-formed half-precision file (F16 [11, 8] spans 176 bytes): the loader names the dtype.
  write(path, file_with_header(
                  R"({"wte.weight":{"dtype":"F16","shape":[11,8],"data_offsets":[0,176]}})", 176));
  CHECK_THAT(load_error(path, kCfg), Catch::Contains("wte.weight") && Catch::Contains("dtype F16"));
}

TEST_CASE("a corrupted safetensors header is a clear error") {
  test::TempDir dir;
  const std::string p = dir.path() + "/bad.safetensors";
  write(p, "abc");
  CHECK_THAT(load_error(p, kCfg), Catch::Contains("not a safetensors file"));
  write(p, std::string("\xff\xff\xff\xff\x00\x00\x00\x00{}", 10));
  CHECK_THAT(load_error(p, kCfg), Catch::Contains("header length"));
  write(p, file_with_header("{\"wte.weight\": {\"dtype\": \"F32\", \"shape\": [11,", 0));
  CHECK_THAT(load_error(p, kCfg), Catch::Contains("corrupt safetensors header"));
  write(p, file_with_header(
               "{\"wte.weight\":{\"dtype\":\"F32\",\"shape\":[11,8],\"data_offsets\":[0,352]}}", 16));
  CHECK_THAT(load_error(p, kCfg), Catch::Contains("outside") && Catch::Contains("wte.weight"));
  CHECK_THAT(load_error(dir.path() + "/missing.safetensors", kCfg),
             Catch::Contains("cannot read"));
}

TEST_CASE("hostile safetensors headers are clear errors, never a crash") {
  test::TempDir dir;
  const std::string p = dir.path() + "/bad.safetensors";
  // Nesting a recursive parser would overflow its stack on.
  write(p, file_with_header(std::string(200000, '[') + std::string(200000, ']'), 0));
  CHECK_THAT(load_error(p, kCfg), Catch::Contains("not a JSON object"));
  const std::pair<std::string, std::string> cases[] = {
      {R"({"wte.weight":{"dtype":"F32","shape":[11,8],"data_offsets":[-4,352]}})", "data_offsets"},
      {R"({"wte.weight":{"dtype":"F32","shape":[11.5,8],"data_offsets":[0,352]}})", "not a size"},
      {R"({"wte.weight":{"dtype":"F32","shape":[11,8],"data_offsets":[352,0]}})", "increasing"},
      {R"({"wte.weight":{"dtype":"F32","shape":[11,8],"data_offsets":[0,1e400]}})", "corrupt safetensors header"},
      {R"({"wte.weight":{"dtype":7,"shape":[11,8],"data_offsets":[0,352]}})", "dtype"},
      {R"({"wte.weight":[1,2,3]})", "not an object"},
      {"{\"wte.weight\":\"\xff\xfe\"}", "corrupt safetensors header"},
      {R"({"wte.weight":{"dtype":"F32","shape":[18446744073709551615,8],"data_offsets":[0,352]}})", "wte.weight"},
  };
  for (const auto& [header, phrase] : cases) {
    INFO(header);
    write(p, file_with_header(header, 352));
    CHECK_THAT(load_error(p, kCfg), Catch::Contains(phrase));
  }
}
