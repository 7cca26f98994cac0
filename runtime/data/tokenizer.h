// The tokenizer trn-data and trn-generate load with --tokenizer, of one of two kinds:
//  - a SentencePiece model (Debian's libsentencepiece), which trn-data also trains. Token ids are
//    SentencePiece's own, so they equal the sentencepiece Python module's on the same model and text.
//  - Hugging Face's tokenizer.json for byte-level BPE (Llama-3, Qwen2/2.5, GPT-2;
//    runtime/data/tokenizer_json.h), whose ids equal Hugging Face's tokenizers library's.
// load() tells them apart by the file: a name ending in .json, or text starting with '{', is a
// tokenizer.json; anything else is read as a SentencePiece model.
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
  struct Impl;

 public:
  // Trains a model on o's files and writes it to out (a temporary name, fsynced and renamed).
  // Usage errors for a file that is missing or not UTF-8 (naming it and the byte offset), a
  // corpus with no text, and SentencePiece's own refusals (a vocabulary larger than the text
  // supports), each in one line.
  static void train(const TrainOptions& o, const std::string& out);

  // Loads a tokenizer.json or a SentencePiece model file; a usage error naming the file when it
  // is missing or not a tokenizer trn reads (one line, saying why).
  static Tokenizer load(const std::string& path);
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  enum class Kind { kSentencePiece, kTokenizerJson };
  Kind kind() const;

  int vocab() const;
  // The ids of text. add_special: with the tokens the tokenizer adds around a whole text, as
  // Hugging Face's encode(text) gives them (a tokenizer.json's post-processor, e.g. Llama-3's
  // <|begin_of_text|>). SentencePiece adds none: its ids are the same either way.
  std::vector<int32_t> encode(std::string_view text, bool add_special = false) const;
  // ids with the tokens the tokenizer adds around a whole text (none for SentencePiece).
  std::vector<int32_t> add_special(std::vector<int32_t> ids) const;
  // The text of ids; a usage error for an id outside the vocabulary.
  std::string decode(const std::vector<int32_t>& ids) const;
  // -1 when the model has none. A tokenizer.json's is the eos_token of the tokenizer_config.json
  // beside it (the file does not hold it itself).
  int32_t eos() const;
  // The id of one token given by its text (a tokenizer.json's added token such as <|eot_id|>, or
  // a piece), or -1 when there is none.
  int32_t token_id(std::string_view text) const;

  // Decoding one token at a time, for printing a continuation as it is sampled: what push(id)
  // returns, concatenated, is the text the tokens add. Bytes of a character that a later token
  // may complete are held back until it does; finish() returns what is still held (an
  // unfinished character as U+FFFD). The stream refers to its tokenizer's model, which must
  // outlive it (a moved Tokenizer keeps it).
  class Stream {
   public:
    std::string push(int32_t id);
    std::string finish();

   private:
    friend class Tokenizer;
    explicit Stream(const Tokenizer::Impl* m) : model_(m) {}
    const Tokenizer::Impl* model_;
    std::vector<int32_t> ids_;  // SentencePiece: all tokens, the context's first
    std::string shown_;         // SentencePiece: the decoding of ids_ returned so far
    std::string pending_;       // tokenizer.json: bytes of an unfinished character
  };
  // A stream continuing `context` (e.g. a prompt's ids), whose own text is not returned.
  Stream stream(const std::vector<int32_t>& context = {}) const;

 private:
  Tokenizer();
  static std::string decode(const Impl& model, const std::vector<int32_t>& ids);
  std::unique_ptr<Impl> p_;
};

}  // namespace trn::data
