// Training data: a token stream (Megatron indexed shards, raw bytes, an llm.c .bin file, or the
// built-in corpus) and the deterministic sampler that cuts it into batches.
//
// The global batch of step s is a pure function of (seed, s): sequence i of step s starts at
// mix(seed, s, i) mod (tokens - seq_len). A data-parallel rank r of dp takes the contiguous
// slice of sequences [r*B/dp, (r+1)*B/dp), so any layout trains on the same tokens. The stream
// of a sharded dataset is its shards back to back, so the same tokens give the same batches
// however they are laid out in files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/data/indexed.h"

namespace trn::data {

// The shard prefixes (PREFIX of PREFIX.bin/.idx) that SPEC names, or none when it names a single
// file of another format:
//   - a directory: its NAME-*.bin shards (NAME is `shard_name`, "train" for --data), sorted;
//   - a glob (a * ? or [): its matching .bin or .idx files' prefixes, sorted;
//   - PREFIX.bin or PREFIX.idx with the other beside it, or PREFIX with both beside it: one shard.
// Usage errors naming `flag` for a directory or glob without shards, a shard without its .idx,
// and a directory trn-data left unfinished or that mixes files its manifest does not name.
std::vector<std::string> shard_prefixes(const std::string& spec, const std::string& flag = "--data",
                                        const std::string& shard_name = "train");

// Opens the shards at `prefixes`, checking each one's directory first (dataset_dir.h): a shard
// in an unfinished or mixed trn-data directory is refused, and one its manifest names must have
// the manifest's size and hash. Usage errors name `flag`.
std::vector<IndexedDataset> open_shards(const std::vector<std::string>& prefixes, const std::string& flag);

class Tokens {
 public:
  // Reads SPEC (see shard_prefixes): indexed shards are mapped, never read whole; any other file
  // is an llm.c .bin (int32 header of 256 words: magic 20240520, version 1, token count; then
  // uint16 tokens) when it starts with that magic, else raw bytes (vocab 256). Usage errors
  // naming `flag` for a missing or malformed file, or a token id >= vocab.
  static Tokens load(const std::string& spec, int vocab, const std::string& flag = "--data",
                     const std::string& shard_name = "train");
  // The built-in corpus (deterministic text, generated; no download), as bytes.
  static Tokens builtin();
  static Tokens from(std::vector<uint16_t> tokens, std::string source);

  size_t size() const { return size_; }
  // Token t of the stream.
  int32_t operator[](size_t t) const;
  // Tokens [first, first + n) into out; a range may span shards.
  void read(size_t first, size_t n, int32_t* out) const;
  const std::string& source() const { return source_; }  // file name, SPEC or "built-in corpus"
  size_t shards() const { return shards_.size(); }  // 0 unless indexed
  // The largest token id (-1 for an empty stream).
  int32_t max_token() const { return max_token_; }

 private:
  std::vector<uint16_t> tokens_;         // raw bytes, llm.c and the built-in corpus
  std::vector<IndexedDataset> shards_;   // or indexed shards, in stream order
  std::vector<size_t> starts_;           // shard k holds stream tokens [starts_[k], starts_[k+1])
  size_t size_ = 0;
  int32_t max_token_ = -1;
  std::string source_;
};

// The vocabulary a sharded dataset needs, its largest token id + 1; 0 when SPEC is not indexed
// shards (then the model's vocabulary comes from elsewhere). Usage errors as for Tokens::load.
int64_t dataset_vocab(const std::string& spec, const std::string& flag = "--data",
                      const std::string& shard_name = "train");

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
