// A SentencePiece tokenizer (Debian's libsentencepiece): trn-data trains and applies it,
// trn-generate encodes prompts and decodes samples with it. Token ids are SentencePiece's own, so
// they equal the sentencepiece Python module's on the same model and text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace trn::data {

class Tokenizer {
 public:
  // Loads a SentencePiece model file; a usage error naming the file when it is missing or not a
  // model.
  static Tokenizer load(const std::string& path);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  int vocab() const;
  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t eos() const;  // -1 when the model has none

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace trn::data
