// A SentencePiece tokenizer (Debian's libsentencepiece): trn-data trains and applies it,
// trn-generate encodes prompts and decodes samples with it. Token ids are SentencePiece's own, so
// they equal the sentencepiece Python module's on the same model and text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace trn::data {

// The byte offset of the first byte of text that does not start or continue a valid UTF-8
// character (overlong forms, surrogates and code points above U+10FFFF are invalid), or
// std::string_view::npos when all of text is valid.
size_t utf8_error_offset(std::string_view text);

// What SentencePiece's trainer needs. Each input file's lines are the training sentences.
struct TrainOptions {
  std::vector<std::string> files;  // in this order; each must be UTF-8
  int vocab = 0;
  std::string model_type = "bpe";  // "bpe" or "unigram"
  uint32_t seed = 1;               // SentencePiece's random generator; training runs on one thread
};

class Tokenizer {
 public:
  // Trains a model on o's files and writes it to out (a temporary name, fsynced and renamed).
  // Usage errors for a file that is missing or not UTF-8 (naming it and the byte offset), a
  // corpus with no text, and SentencePiece's own refusals (a vocabulary larger than the text
  // supports), each in one line.
  static void train(const TrainOptions& o, const std::string& out);

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
