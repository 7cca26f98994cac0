// Training data: a token stream (raw bytes, an llm.c .bin file, or the built-in corpus) and the
// deterministic sampler that cuts it into batches.
//
// The global batch of step s is a pure function of (seed, s): sequence i of step s starts at
// mix(seed, s, i) mod (tokens - seq_len). A data-parallel rank r of dp takes the contiguous
// slice of sequences [r*B/dp, (r+1)*B/dp), so any layout trains on the same tokens.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace trn::data {

class Tokens {
 public:
  // Reads FILE: an llm.c .bin (int32 header of 256 words: magic 20240520, version 1, token
  // count; then uint16 tokens) when it starts with that magic, else raw bytes (vocab 256).
  // Usage errors for a missing or malformed file, or a token id >= vocab.
  static Tokens load(const std::string& path, int vocab);
  // The built-in corpus (deterministic text, generated; no download), as bytes.
  static Tokens builtin();
  static Tokens from(std::vector<uint16_t> tokens, std::string source);

  size_t size() const { return tokens_.size(); }
  const uint16_t* data() const { return tokens_.data(); }
  const std::string& source() const { return source_; }  // file name or "built-in corpus"

 private:
  std::vector<uint16_t> tokens_;
  std::string source_;
};

// The text of the built-in corpus: about `bytes` bytes of English-like sentences and small
// arithmetic facts produced by a fixed grammar from a fixed seed.
std::string builtin_corpus_text(size_t bytes = 1 << 20);

// Writes an llm.c .bin token file (temp file, fsync, rename).
void write_llmc_bin(const std::string& path, const std::vector<uint16_t>& tokens);

class Sampler {
 public:
  // Usage error when the data holds fewer than seq_len + 1 tokens.
  Sampler(const Tokens& tokens, int seq_len, uint64_t seed);
  // Sequences [first, first + count) of the global batch of `step`: inputs and targets are
  // (count, seq_len), targets shifted by one token.
  void fill(int64_t step, int first, int count, int32_t* inputs, int32_t* targets) const;
  // Start offset of sequence i of step s.
  size_t start(int64_t step, int i) const;

 private:
  const Tokens& tokens_;
  int T_;
  uint64_t seed_;
};

}  // namespace trn::data
