// Fuzz target: tokenizer models (runtime/data/tokenizer.h), what trn-data and trn-generate load
// with --tokenizer, and the UTF-8 check trn-data runs on its input text. An input's parts
// (fuzz.h) are a tokenizer file (a SentencePiece model, or a tokenizer.json when it starts with
// '{') and a text: a model that loads encodes the text, with and without its post-processor's
// tokens, and the ids it gives decode, at once and as a stream.
#include "runtime/data/tokenizer.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  const auto parts = fuzz::split(data, size, 2);
  const std::string_view text = parts.size() > 1 ? parts[1] : parts[0];
  const size_t bad = data::utf8_error_offset(text);
  fuzz::require(bad == std::string_view::npos || bad < text.size(), "utf8_error_offset points past the text");
  const std::string path = (fuzz::scratch() / "tok.model").string();
  fuzz::put(path, parts[0]);
  std::optional<data::Tokenizer> tok;
  if (!fuzz::accepts([&] { tok.emplace(data::Tokenizer::load(path)); })) return 0;
  fuzz::require(tok->vocab() > 0, "a loaded tokenizer has no vocabulary");
  if (parts.size() < 2 || bad != std::string_view::npos) return 0;  // trn-data refuses such text first
  std::vector<int32_t> ids;
  if (!fuzz::accepts([&] { ids = tok->encode(text); })) return 0;
  for (int32_t id : ids) fuzz::require(id >= 0 && id < tok->vocab(), "encode gave an id outside the vocabulary");
  std::string whole;
  if (!fuzz::accepts([&] { whole = tok->decode(ids); })) return 0;
  if (tok->kind() == data::Tokenizer::Kind::kTokenizerJson) {
    std::string streamed;
    auto stream = tok->stream();
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.finish();
    fuzz::require(streamed == whole, "stream decoding differs from decoding the whole");
  }
  fuzz::accepts([&] { tok->encode(text, /*add_special=*/true); });
  return 0;
}
