// Fuzz target: safetensors files (runtime/io/safetensors.h), what `--init` and trn-generate
// read. Any bytes are parsed as a file; a file that parses must obey the format's layout rule
// (its tensors tile the data: in order of offset, back to back from byte 0 to the end, so no
// byte is claimed twice or by none); a file that loads into a tiny GPT-2 or Llama is then
// written back with save_gpt2 and read again, and must give the same parameters bit for bit.
#include <algorithm>
#include <cstring>

#include "runtime/io/safetensors.h"
#include "tests/fuzz/fuzz.h"

namespace {

trn::model::Config tiny(const char* arch) {
  trn::model::Config c;
  c.arch = arch;
  c.n_layer = 1;
  c.n_head = 2;
  c.d_model = 4;
  c.ctx = 4;
  c.vocab = 8;
  if (c.arch == "llama") {
    c.n_kv_head = 1;
    c.ffn_dim = 8;
    c.tie_embeddings = false;
  }
  return c;
}

void round_trip(const std::string& path, const trn::model::Config& c) {
  using namespace trn;
  const model::ParamLayout layout(c);
  std::vector<float> params(layout.total());
  if (!fuzz::accepts([&] { io::load_gpt2(path, layout, params.data()); })) return;
  const std::string again = (fuzz::scratch() / "again.safetensors").string();
  io::save_gpt2(again, layout, params.data(), {{"fuzz", "round trip"}});
  std::vector<float> back(layout.total(), -1.0f);
  io::load_gpt2(again, layout, back.data());
  fuzz::require(std::memcmp(params.data(), back.data(), params.size() * sizeof(float)) == 0,
                "save_gpt2 then load_gpt2 changed the parameters of " + c.describe());
  fuzz::require(io::read_safetensors_metadata(again).at("fuzz") == "round trip", "metadata lost");
}

// The tensors' byte ranges, sorted, cover [0, data) exactly once.
bool tiles(const trn::io::SafetensorsFile& f, size_t data) {
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, t] : f.tensors()) ranges.emplace_back(t.begin, t.end);
  std::sort(ranges.begin(), ranges.end());
  size_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (b != at) return false;
    at = e;
  }
  return at == data;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  const std::string path = (fuzz::scratch() / "in.safetensors").string();
  fuzz::put(path, std::string_view(reinterpret_cast<const char*>(data), size));
  fuzz::accepts([&] { io::read_safetensors_metadata(path); });
  bool parsed = fuzz::accepts([&] {
    io::SafetensorsFile f(path);
    uint64_t header = 0;
    std::memcpy(&header, data, 8);  // parsed, so at least 8 bytes and the length fits
    fuzz::require(tiles(f, size - 8 - size_t(header)), "accepted a file whose tensors do not tile its data");
    uint64_t sum = 0;  // every byte a tensor claims is read: an offset past the data would fault
    for (const auto& [name, t] : f.tensors())
      for (size_t i = 0; i < t.end - t.begin; ++i) sum += static_cast<unsigned char>(f.data(t)[i]);
    (void)sum;
  });
  if (parsed) {
    round_trip(path, tiny("gpt2"));
    round_trip(path, tiny("llama"));
  }
  return 0;
}
