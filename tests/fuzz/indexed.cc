// Fuzz target: Megatron indexed shards (runtime/data/indexed.h), what --data reads from trn-data
// or Megatron. An input's parts (fuzz.h) are train-00000.idx, train-00000.bin, train-00001.idx,
// train-00001.bin, ...: the folder is opened as --data would open it, and each shard on its own.
// A shard that opens is read through, written again with IndexedWriter and must read back the
// same sequences.
#include "runtime/data/data.h"
#include "runtime/data/indexed.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  namespace fs = std::filesystem;
  const auto parts = fuzz::split(data, size, 4);
  const fs::path dir = fuzz::scratch() / "shards";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  std::vector<std::string> prefixes;
  for (size_t k = 0; 2 * k < parts.size(); ++k) {
    const std::string prefix = (dir / fmt::format("train-{:05}", k)).string();
    fuzz::put(prefix + ".idx", parts[2 * k]);
    fuzz::put(prefix + ".bin", 2 * k + 1 < parts.size() ? parts[2 * k + 1] : std::string_view());
    prefixes.push_back(prefix);
  }
  fuzz::accepts([&] { data::dataset_vocab(dir.string()); });
  fuzz::accepts([&] {
    const data::Tokens t = data::Tokens::load(dir.string(), 1 << 30);
    if (t.size() > 0) {
      int32_t first = -1, last = -1;
      t.read(0, 1, &first);
      t.read(t.size() - 1, 1, &last);
      fuzz::require(first == t[0] && last == t[t.size() - 1], "Tokens::read and operator[] disagree");
    }
  });
  for (const auto& prefix : prefixes) {
    std::optional<data::IndexedDataset> d;
    if (!fuzz::accepts([&] { d.emplace(data::IndexedDataset::open(prefix)); })) continue;
    std::vector<std::vector<int32_t>> seqs(d->sequences());
    size_t tokens = 0;
    int32_t max_token = -1;
    for (size_t i = 0; i < seqs.size(); ++i) {
      d->read(i, &seqs[i]);
      for (int32_t v : seqs[i]) {
        fuzz::require(v >= 0 && v == d->token(tokens), "read() and token() disagree, or a token is negative");
        max_token = std::max(max_token, v);
        ++tokens;
      }
    }
    fuzz::require(tokens == d->tokens() && max_token == d->max_token(), "the shard's counts disagree with its tokens");
    if (tokens > 0) {
      std::vector<int32_t> stream(tokens);
      d->read_tokens(0, tokens, stream.data());
      fuzz::require(stream.back() == d->token(tokens - 1), "read_tokens() and token() disagree");
    }
    const std::string again = (fuzz::scratch() / "again").string();
    data::IndexedWriter w(again, int64_t{max_token} + 1);
    for (const auto& s : seqs) w.add_document(s.data(), s.size());
    w.finish();
    const data::IndexedDataset back = data::IndexedDataset::open(again);
    fuzz::require(back.sequences() == seqs.size(), "a shard written again has another sequence count");
    std::vector<int32_t> got;
    for (size_t i = 0; i < seqs.size(); ++i) {
      back.read(i, &got);
      fuzz::require(got == seqs[i], "a shard written again differs");
    }
  }
  return 0;
}
