// The tensors of a safetensors file tile its data exactly, as the format requires: in order of
// offset, each starts where the one before ends, the first at 0 and the last at the end of the
// file, and each spans its dtype's size times its elements. Anything else (two tensors sharing
// bytes, a gap, trailing bytes) is refused in one line.
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>

#include "collectives/core/error.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/one_stage.h"
#include "tests/support/process.h"

using namespace trn;

namespace {

void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file by hand: 8-byte header length, the JSON header, then `data_bytes` bytes of data.
std::string file_with(const std::string& json, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + std::string(data_bytes, '\x01');
}

std::string parse_error(const std::string& path) {
  try {
    io::SafetensorsFile f(path);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("safetensors data_offsets must tile the data: no overlap, gap or trailing bytes") {
  test::TempDir dir;
  const std::string p = dir.path() + "/w.safetensors";
  struct Case {
    std::string header;
    size_t data;
    std::string phrase;
  };
  const Case refused[] = {
      // Both tensors on the same 8 bytes: writing one would change the other.
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, "tensor b data_offsets [0, 8] overlap tensor a, which ends at byte 8"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "overlap tensor a"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, "tensor b starts at byte 8, but the tensors before it end at byte 4"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
       12, "tensor a starts at byte 4, but the tensors before it end at byte 0"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8,
       "4 trailing bytes belong to no tensor"},
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "F32 [3] needs 12 bytes"},
  };
  for (const auto& c : refused) {
    INFO(c.header);
    put(p, file_with(c.header, c.data));
    const std::string e = parse_error(p);
    CHECK_THAT(
        e, Catch::Contains(c.phrase) && Catch::Contains(p) && Catch::Contains("corrupt safetensors header"));
  }
  // Tiling in any key order, an empty tensor anywhere, and a dtype the format defines.
  put(p,
      file_with(
          R"({"__metadata__":{"k":"v"},"z":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
          R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}})",
          8));
  CHECK(parse_error(p) == "accepted");
}

TEST_CASE("a model saved by trn tiles its data and loads; the same file with two tensors aliased does not") {
  test::TempDir dir;
  const model::Config c{1, 2, 4, 4, 8};
  model::OneStageModel m(c, 1, 4, 1);
  m.init(3);
  const std::string p = dir.path() + "/w.safetensors";
  io::save_gpt2(p, m.layout(), m.params());
  CHECK(parse_error(p) == "accepted");
  // ln_f.bias and ln_f.weight have the same shape: point the bias at the weight's bytes and keep
  // the file's size (the header is padded back to its length).
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t len;
  std::memcpy(&len, bytes.data(), 8);
  std::string header = bytes.substr(8, len);
  io::SafetensorsFile f(p);
  const auto& w = f.tensors().at("ln_f.weight");
  const auto& b = f.tensors().at("ln_f.bias");
  const std::string from = "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[" +
                           std::to_string(b.begin) + "," + std::to_string(b.end) + "]}";
  const std::string to = "\"ln_f.bias\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[" +
                         std::to_string(w.begin) + "," + std::to_string(w.end) + "]}";
  const size_t at = header.find(from);
  REQUIRE(at != std::string::npos);
  REQUIRE(to.size() <= from.size());
  header.replace(at, from.size(), to + std::string(from.size() - to.size(), ' '));
  // Still valid JSON: spaces between tokens. The data is unchanged, so one tensor's bytes are
  // now claimed twice and another's by none.
  bytes.replace(8, len, header);
  put(p, bytes);
  model::ParamLayout lay(c);
  std::vector<float> params(lay.total());
  try {
    io::load_gpt2(p, lay, params.data());
    FAIL("a file whose tensors share bytes was loaded");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::kUsage);
    CHECK_THAT(e.what(), Catch::Contains("overlap") || Catch::Contains("gap"));
  }
}
