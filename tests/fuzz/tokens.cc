// Fuzz target: single-file token data (runtime/data/data.h Tokens::load): an llm.c .bin (a
// 256-word header, then uint16 tokens) or, without its magic, raw bytes. Whatever loads is read
// through and sampled; an llm.c file is written again with write_llmc_bin and must read back the
// same tokens.
#include "runtime/data/data.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  const std::string path = (fuzz::scratch() / "tokens.bin").string();
  fuzz::put(path, std::string_view(reinterpret_cast<const char*>(data), size));
  std::optional<data::Tokens> t;
  if (!fuzz::accepts([&] { t.emplace(data::Tokens::load(path, 65536)); })) return 0;
  std::vector<int32_t> all(t->size());
  t->read(0, all.size(), all.data());
  for (size_t i = 0; i < all.size(); ++i) fuzz::require(all[i] == (*t)[i] && all[i] >= 0 && all[i] <= t->max_token(),
                                                        "read() and operator[] disagree, or a token is out of range");
  if (t->size() >= 5) {
    data::Sampler s(*t, 4, 7);
    int32_t in[8], out[8];
    s.fill(3, 0, 2, in, out);
  }
  constexpr int32_t kMagic = 20240520;
  int32_t magic = 0;
  if (size >= 1024) std::memcpy(&magic, data, 4);
  if (magic != kMagic) return 0;
  std::vector<uint16_t> tokens(all.begin(), all.end());
  const std::string again = (fuzz::scratch() / "again.bin").string();
  data::write_llmc_bin(again, tokens);
  const data::Tokens back = data::Tokens::load(again, 65536);
  fuzz::require(back.size() == t->size(), "an llm.c file written again has another length");
  for (size_t i = 0; i < all.size(); ++i) fuzz::require(back[i] == all[i], "an llm.c file written again differs");
  return 0;
}
