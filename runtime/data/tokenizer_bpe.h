// The BPE model of a byte-level tokenizer.json: a pre-token's bytes start as one symbol each and
// the adjacent pair whose merge ranks first is merged, again and again, until no adjacent pair
// has a merge. Pieces are held as the bytes they stand for, not in GPT-2's character spelling.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace trn::data {

// Lets the maps below be searched by string_view without building a string.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};

class BpeModel {
 public:
  BpeModel();
  ~BpeModel();

  // Building, before any encode. reserve: room for this many pieces and merges.
  void reserve(size_t pieces, size_t merges) {
    ids_.reserve(pieces);
    merges_.reserve(merges);
  }
  // A piece's id; false when the bytes already have one.
  bool add_piece(std::string bytes, int32_t id);
  // The next merge in rank order: left + right -> their concatenation. A message for a merge
  // whose parts or result are not pieces (what Hugging Face refuses too), else empty.
  std::string add_merge(std::string_view left, std::string_view right);
  // Hugging Face's ignore_merges (Llama-3): a pre-token that is a piece is that piece, whatever
  // the merges would make of it.
  void set_ignore_merges(bool on) { ignore_merges_ = on; }
  void set_unk(int32_t id) { unk_ = id; }
  int32_t find(std::string_view bytes) const;  // -1 when no piece has them

  // Appends the ids of one pre-token. A usage error names a byte that has no piece when the
  // model has no unknown token (byte-level vocabularies hold all 256).
  void encode(std::string_view word, std::vector<int32_t>* out) const;

 private:
  struct Merge {
    int32_t rank, id;
  };
  void merge(std::string_view word, std::vector<int32_t>* out) const;

  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> ids_;
  std::array<int32_t, 256> byte_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: left id << 32 | right id
  bool ignore_merges_ = false;
  int32_t unk_ = -1;

  // Pre-tokens repeat (words, indentation): their ids are kept, in shards each under its own
  // lock so encoding threads (trn-data tokenize --threads) rarely wait on each other. A shard
  // that fills up is emptied: a bound on memory, not an eviction policy.
  struct Cache {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> words;
  };
  static constexpr size_t kCacheShards = 16, kCacheShardWords = 8192, kCacheMaxBytes = 64;
  std::unique_ptr<Cache[]> cache_;
};

}  // namespace trn::data
