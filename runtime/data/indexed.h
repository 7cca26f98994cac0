// Megatron's indexed dataset (the MMIDIDX format, version 1), written and read by trn: a token
// shard is PREFIX.bin, the tokens of every sequence back to back in one dtype, and PREFIX.idx:
//
//   magic "MMIDIDX\0\0" (9 bytes), version uint64 = 1, dtype code uint8 (1 uint8, 2 int8,
//   3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), sequence count uint64 S,
//   document-index count uint64 D; then int32 sizes[S] (tokens per sequence), int64
//   pointers[S] (byte offset of each sequence in .bin), int64 doc_idx[D] (sequence index where
//   each document starts, doc_idx[0] = 0 and doc_idx[D-1] = S). All little-endian.
//
// trn writes one sequence per document (D = S + 1), in uint16 when the vocabulary is below
// 65500 and int32 otherwise, so a corpus tokenized for Megatron trains in trn and the other way
// round. Readers map both files (mmap): nothing is read whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace trn::data {

// The dtype code Megatron uses for a vocabulary of this size: 8 (uint16) below 65500, else 4
// (int32).
int dtype_for_vocab(int64_t vocab);

// Writes PREFIX.bin and PREFIX.idx (each to a temporary name, fsynced and renamed when finish()
// runs; a writer destroyed before finish() leaves no file behind).
class IndexedWriter {
 public:
  IndexedWriter(const std::string& prefix, int64_t vocab);
  ~IndexedWriter();
  void add_document(const int32_t* tokens, size_t n);  // one sequence, one document
  void finish();
  size_t documents() const;
  size_t tokens() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// A shard, mapped. Usage errors (naming the file and what is wrong) for a bad magic, version or
// dtype (a token dtype: codes 1-5 and 8), an index whose size disagrees with its counts, sizes
// and pointers that disagree with its .bin (trn requires the sequences back to back, as
// Megatron writes them: pointer i = the bytes of sequences 0..i-1, and .bin exactly their sum),
// document indices not starting at 0, out of order or not ending at S, or a negative token.
class IndexedDataset {
 public:
  static IndexedDataset open(const std::string& prefix);
  IndexedDataset(IndexedDataset&&) noexcept;
  IndexedDataset& operator=(IndexedDataset&&) noexcept;
  ~IndexedDataset();

  const std::string& prefix() const;
  int dtype() const;
  size_t sequences() const;
  size_t documents() const;  // doc_idx entries - 1
  size_t tokens() const;     // in every sequence
  // Sequence i's tokens, widened: out receives sizes[i] values.
  void read(size_t i, std::vector<int32_t>* out) const;
  // Token t of the shard's concatenated token stream (all sequences back to back).
  int32_t token(size_t t) const;
  // Tokens [first, first + n) of that stream into out (the fast path of a sampler's copy).
  void read_tokens(size_t first, size_t n, int32_t* out) const;
  int32_t max_token() const;  // the largest token id (scanned once, at open)
  // The mapped files, as they were read (to check them against a dataset manifest).
  std::string_view bin_bytes() const;
  std::string_view idx_bytes() const;

 private:
  IndexedDataset();
  struct Map;
  std::unique_ptr<Map> m_;
};

}  // namespace trn::data
