#include "runtime/data/tokenizer_bpe.h"

#include <queue>

#include "collectives/core/error.h"

namespace trn::data {

BpeModel::BpeModel() : cache_(new Cache[kCacheShards]) { byte_id_.fill(-1); }
BpeModel::~BpeModel() = default;

bool BpeModel::add_piece(std::string bytes, int32_t id) {
  if (bytes.size() == 1) byte_id_[uint8_t(bytes[0])] = id;
  return ids_.emplace(std::move(bytes), id).second;
}

int32_t BpeModel::find(std::string_view bytes) const {
  const auto it = ids_.find(bytes);
  return it == ids_.end() ? -1 : it->second;
}

std::string BpeModel::add_merge(std::string_view left, std::string_view right) {
  const int32_t l = find(left), r = find(right);
  if (l < 0 || r < 0) return "a part of it is not in the vocabulary";
  const int32_t id = find(std::string(left) + std::string(right));
  if (id < 0) return "what it makes is not in the vocabulary";
  const uint64_t key = uint64_t(uint32_t(l)) << 32 | uint32_t(r);
  // A pair listed twice keeps its first (best) rank, as Hugging Face's loader does.
  merges_.emplace(key, Merge{int32_t(merges_.size()), id});
  return {};
}

void BpeModel::encode(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const int32_t id = find(word); id >= 0) {
      out->push_back(id);
      return;
    }
  }
  if (word.size() > kCacheMaxBytes) {
    merge(word, out);
    return;
  }
  Cache& shard = cache_[StringHash()(word) % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    const auto it = shard.words.find(word);
    if (it != shard.words.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out->size();
  merge(word, out);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.words.size() >= kCacheShardWords) shard.words.clear();
  shard.words.emplace(std::string(word), std::vector<int32_t>(out->begin() + start, out->end()));
}

// The merges run on a doubly linked list of symbols with a queue of candidate pairs ordered by
// (rank, position): the pair popped is the best-ranked one, leftmost among equals. A candidate
// is stale when its left symbol was merged away, has no right neighbour any more, or the pair
// there now merges into something else; stale candidates are dropped when popped. Each merge
// queues the new symbol's pairs with its neighbours. O(n log n) in the pre-token's length.
void BpeModel::merge(std::string_view word, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (size_t i = 0; i < word.size(); ++i) {
    int32_t id = byte_id_[uint8_t(word[i])];
    if (id < 0) {
      if (unk_ < 0)
        throw usage_error("the tokenizer has no piece for the byte 0x{:02X} and no unknown token",
                          uint8_t(word[i]));
      id = unk_;
    }
    sym.push_back({id, int32_t(i) - 1, i + 1 < word.size() ? int32_t(i) + 1 : -1, true});
  }
  struct Candidate {
    int32_t rank, pos, id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto lookup = [&](int32_t l, int32_t r) -> const Merge* {
    const auto it = merges_.find(uint64_t(uint32_t(l)) << 32 | uint32_t(r));
    return it == merges_.end() ? nullptr : &it->second;
  };
  auto offer = [&](int32_t pos) {
    if (pos < 0 || sym[pos].next < 0) return;
    if (const Merge* m = lookup(sym[pos].id, sym[sym[pos].next].id)) queue.push({m->rank, pos, m->id});
  };
  for (int32_t i = 0; i + 1 < int32_t(sym.size()); ++i) offer(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    Symbol& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[left.next];
    const Merge* m = lookup(left.id, right.id);
    if (m == nullptr || m->id != c.id) continue;
    left.id = c.id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) sym[left.next].prev = c.pos;
    offer(left.prev);
    offer(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out->push_back(sym[i].id);
}

}  // namespace trn::data
