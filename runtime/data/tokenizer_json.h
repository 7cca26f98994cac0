// Hugging Face's tokenizer.json for byte-level BPE, the tokenizer of Llama-3, Qwen2/2.5 and GPT-2:
//
//   text -> added tokens (special tokens and the like), matched first on the raw text
//        -> normalizer on the text between them (none, or NFC by ICU)
//        -> pre-tokenizer: Split by a regex (Oniguruma), ByteLevel (bytes as GPT-2's characters,
//           with GPT-2's own regex when use_regex is set)
//        -> BPE on each pre-token's bytes (tokenizer_bpe.h)
//        -> post-processor (ByteLevel: nothing to add; TemplateProcessing, RobertaProcessing,
//           BertProcessing: the tokens around the text, e.g. Llama-3's <|begin_of_text|>)
//
// Decoding maps each token back to its bytes (an added token to its text) and reads them as
// UTF-8, an ill-formed part becoming U+FFFD as Hugging Face's ByteLevel decoder does.
//
// What trn does not implement is refused by name when the file loads, in one line: another model
// (WordPiece, Unigram, WordLevel), BPE without the byte-level steps (Llama-2's byte_fallback), and
// any normalizer, pre-tokenizer, post-processor, decoder or added-token option not listed above.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace trn::data {

class JsonTokenizer {
 public:
  // A tokenizer.json read from path (its bytes: text), with the eos_token of the
  // tokenizer_config.json beside it when there is one. Usage errors, each one line naming the
  // file: not JSON, not a tokenizer.json, or a part trn does not implement.
  static std::unique_ptr<JsonTokenizer> load(const std::string& path, std::string_view text);
  // The same from the file's text; `name` stands for the file in errors.
  static std::unique_ptr<JsonTokenizer> parse(std::string_view json, const std::string& name);
  ~JsonTokenizer();

  int vocab() const;    // one past the largest id, of the model's pieces and the added tokens
  int32_t eos() const;  // tokenizer_config.json's eos_token, or -1
  int32_t bos() const;  // the post-processor's first added token, or -1
  void set_eos(int32_t id);

  // The ids of text (UTF-8; a usage error otherwise). add_special: with the post-processor's
  // tokens, as Hugging Face's encode(text) gives them (add_special_tokens=True).
  std::vector<int32_t> encode(std::string_view text, bool add_special) const;
  // ids with the post-processor's tokens around them (encode(text, true) is
  // add_special(encode(text, false))).
  std::vector<int32_t> add_special(std::vector<int32_t> ids) const;
  // Appends the bytes token id stands for; a usage error for an id that is no token.
  void append_bytes(int32_t id, std::string* out) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int32_t token_id(std::string_view text) const;  // an added token's or a piece's id, or -1

 private:
  JsonTokenizer();
  struct Impl;
  std::unique_ptr<Impl> p_;
};

}  // namespace trn::data
