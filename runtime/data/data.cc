#include "runtime/data/data.h"

#include <dirent.h>
#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>

#include "collectives/core/error.h"
#include "runtime/data/dataset_dir.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"
#include "runtime/util/random.h"

namespace trn::data {
namespace {
constexpr int32_t kMagic = 20240520;
constexpr int kHeaderWords = 256;

bool exists(const std::string& path, bool want_dir = false) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && (want_dir ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode));
}
bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}
std::string without_ext(const std::string& path) { return path.substr(0, path.size() - 4); }

// A shard prefix from a .bin or .idx path, checking its partner file is there.
std::string shard_of(const std::string& path, const std::string& flag) {
  const std::string prefix = without_ext(path);
  const std::string other = prefix + (ends_with(path, ".bin") ? ".idx" : ".bin");
  if (!exists(other))
    throw usage_error("{} {}: shard {} has no {} beside it; an indexed shard is PREFIX.bin and PREFIX.idx", flag,
                      path, path, other);
  return prefix;
}
}  // namespace

std::vector<std::string> shard_prefixes(const std::string& spec, const std::string& flag,
                                        const std::string& shard_name) {
  std::vector<std::string> out;
  if (exists(spec, true)) {
    check_dataset_dir(spec, flag);  // an unfinished or mixed trn-data directory is refused first
    DIR* d = ::opendir(spec.c_str());
    if (!d) throw usage_error("{} {}: cannot read the directory: {}", flag, spec, std::strerror(errno));
    const std::string head = shard_name + "-";
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.compare(0, head.size(), head) == 0 && ends_with(name, ".bin")) out.push_back(spec + "/" + name);
    }
    ::closedir(d);
    if (out.empty())
      throw usage_error("{} {} is a directory without {}-*.bin shards; pass a directory written by trn-data "
                        "tokenize, a glob of .bin shards, or one file",
                        flag, spec, shard_name);
    std::sort(out.begin(), out.end());
    for (auto& p : out) p = shard_of(p, flag);
    return out;
  }
  if (spec.find_first_of("*?[") != std::string::npos && !exists(spec)) {
    glob_t g{};
    const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
    std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
    ::globfree(&g);
    if (rc != 0 && rc != GLOB_NOMATCH) throw usage_error("{} {}: the glob cannot be read", flag, spec);
    for (const auto& m : matches)
      if (ends_with(m, ".bin") || ends_with(m, ".idx")) out.push_back(shard_of(m, flag));
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    if (out.empty())
      throw usage_error("{} {}: the glob matches no .bin/.idx shards ({} file{} matched)", flag, spec,
                        matches.size(), matches.size() == 1 ? "" : "s");
    return out;
  }
  if ((ends_with(spec, ".bin") && exists(without_ext(spec) + ".idx")) || ends_with(spec, ".idx"))
    return {shard_of(spec, flag)};
  if (!exists(spec) && exists(spec + ".bin") && exists(spec + ".idx")) return {spec};
  return out;
}

std::vector<IndexedDataset> open_shards(const std::vector<std::string>& prefixes, const std::string& flag) {
  std::map<std::string, std::optional<DatasetManifest>> dirs;  // each directory checked once
  std::vector<IndexedDataset> out;
  for (const auto& p : prefixes) {
    const std::string dir = parent_dir(p);
    auto it = dirs.find(dir);
    if (it == dirs.end()) it = dirs.emplace(dir, check_dataset_dir(dir, flag)).first;
    out.push_back(IndexedDataset::open(p));
    if (!it->second) continue;  // not trn-data's: read as it is
    const std::string name = p.substr(p.rfind('/') + 1);  // npos + 1 is 0: a bare prefix
    const std::pair<const char*, std::string_view> files[] = {{".bin", out.back().bin_bytes()},
                                                              {".idx", out.back().idx_bytes()}};
    for (const auto& [ext, bytes] : files) {
      const auto f = it->second->find(name + ext);
      if (f == it->second->end())  // check_dataset_dir saw every file: only a race gets here
        throw usage_error("{}: {}{} is not named by {}'s manifest; tokenize the dataset again", flag, p, ext, dir);
      check_digest(flag, p + ext, f->second, bytes.data(), bytes.size());
    }
  }
  return out;
}

int32_t Tokens::operator[](size_t t) const {
  if (shards_.empty()) return tokens_[t];
  const size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), t) - starts_.begin()) - 1;
  return shards_[k].token(t - starts_[k]);
}

void Tokens::read(size_t first, size_t n, int32_t* out) const {
  TRN_CHECK(first <= size_ && n <= size_ - first);
  if (shards_.empty()) {
    for (size_t i = 0; i < n; ++i) out[i] = tokens_[first + i];
    return;
  }
  size_t k = size_t(std::upper_bound(starts_.begin(), starts_.end(), first) - starts_.begin()) - 1;
  while (n > 0) {
    // Empty shards have starts_[k] == starts_[k+1]; upper_bound already skipped them, and the
    // loop below moves past any that follow.
    const size_t off = first - starts_[k], take = std::min(n, shards_[k].tokens() - off);
    shards_[k].read_tokens(off, take, out);
    out += take;
    first += take;
    n -= take;
    ++k;
  }
}

Tokens Tokens::from(std::vector<uint16_t> tokens, std::string source) {
  Tokens t;
  t.tokens_ = std::move(tokens);
  t.size_ = t.tokens_.size();
  for (uint16_t v : t.tokens_) t.max_token_ = std::max<int32_t>(t.max_token_, v);
  t.source_ = std::move(source);
  return t;
}

int64_t dataset_vocab(const std::string& spec, const std::string& flag, const std::string& shard_name) {
  int32_t mx = -1;
  const auto prefixes = shard_prefixes(spec, flag, shard_name);
  if (prefixes.empty()) return 0;
  for (const auto& ds : open_shards(prefixes, flag)) mx = std::max(mx, ds.max_token());
  return int64_t(mx) + 1;
}

Tokens Tokens::load(const std::string& path, int vocab, const std::string& flag, const std::string& shard_name) {
  if (const auto prefixes = shard_prefixes(path, flag, shard_name); !prefixes.empty()) {
    Tokens t;
    t.source_ = path;
    t.starts_.push_back(0);
    t.shards_ = open_shards(prefixes, flag);
    for (const auto& ds : t.shards_) {
      t.size_ += ds.tokens();
      t.starts_.push_back(t.size_);
      t.max_token_ = std::max(t.max_token_, ds.max_token());
    }
    if (t.max_token_ >= vocab)
      throw usage_error("{} {}: its largest token id is {}, so it needs a vocabulary of {} or more, but the model's "
                        "vocabulary is {}; pass --vocab {} or more, or leave --vocab out to take it from the data",
                        flag, path, t.max_token_, int64_t(t.max_token_) + 1, vocab, int64_t(t.max_token_) + 1);
    return t;
  }
  const std::string bytes = io::read_input_file(flag, path);
  std::vector<uint16_t> tokens;
  int32_t header[kHeaderWords] = {};
  if (bytes.size() >= sizeof header) std::memcpy(header, bytes.data(), sizeof header);
  if (bytes.size() >= sizeof header && header[0] == kMagic) {
    if (header[1] != 1)
      throw usage_error("data file {}: llm.c .bin version {} is not supported (expected 1)", path,
                        header[1]);
    const size_t count = static_cast<uint32_t>(header[2]);
    // The file is the header and then exactly `count` 2-byte tokens.
    const size_t expect = sizeof header + 2 * count;
    if (bytes.size() != expect) {
      const size_t diff = bytes.size() > expect ? bytes.size() - expect : expect - bytes.size();
      throw usage_error("data file {}: llm.c header says {} tokens, so the file should be {} bytes ({}-byte header "
                        "+ 2 x {}), but it is {} bytes: {} {} byte{}; the file is {}",
                        path, count, expect, sizeof header, count, bytes.size(), diff,
                        bytes.size() > expect ? "extra" : "missing", diff == 1 ? "" : "s",
                        bytes.size() > expect ? "corrupt or was written by another tool" : "truncated");
    }
    tokens.resize(count);
    if (count > 0) std::memcpy(tokens.data(), bytes.data() + sizeof header, count * 2);
    for (size_t i = 0; i < count; ++i)
      if (tokens[i] >= vocab)
        throw usage_error("data file {}: token {} at position {} is not below the vocabulary "
                          "size {}; pass --vocab {} or more",
                          path, tokens[i], i, vocab, tokens[i] + 1);
  } else {
    // A .bin file is an llm.c token file: one whose header is short or whose magic is off is
    // corrupt, not text to train on as bytes.
    if (path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0) {
      if (bytes.size() < sizeof header)
        throw usage_error("data file {}: an llm.c .bin needs a {}-byte header but the file has {} bytes; "
                          "it is truncated (raw text files must not end in .bin)",
                          path, sizeof header, bytes.size());
      throw usage_error("data file {}: llm.c .bin magic is {}, expected {}; the file is corrupt or not "
                        "an llm.c token file (raw text files must not end in .bin)",
                        path, header[0], kMagic);
    }
    if (vocab < 256)
      throw usage_error("data file {} is raw bytes, which needs --vocab 256 or more (got {})", path,
                        vocab);
    tokens.assign(reinterpret_cast<const unsigned char*>(bytes.data()),
                  reinterpret_cast<const unsigned char*>(bytes.data()) + bytes.size());
  }
  return from(std::move(tokens), path);
}

Tokens Tokens::builtin() {
  const std::string text = builtin_corpus_text();
  return from(std::vector<uint16_t>(reinterpret_cast<const unsigned char*>(text.data()),
                                    reinterpret_cast<const unsigned char*>(text.data()) +
                                        text.size()),
              "built-in corpus");
}

void write_llmc_bin(const std::string& path, const std::vector<uint16_t>& tokens) {
  int32_t header[kHeaderWords] = {};
  header[0] = kMagic;
  header[1] = 1;
  header[2] = static_cast<int32_t>(tokens.size());
  std::string bytes(reinterpret_cast<const char*>(header), sizeof header);
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  io::write_file_atomic(path, bytes);
}

Sampler::Sampler(const Tokens& tokens, int seq_len, uint64_t seed)
    : tokens_(tokens), T_(seq_len), seed_(seed) {
  if (tokens.size() < size_t(seq_len) + 1)
    throw usage_error("data {} has {} tokens, fewer than one sequence of {} + 1; use a larger file "
                      "or a shorter --ctx",
                      tokens.source(), tokens.size(), seq_len);
}

size_t Sampler::start(int64_t step, int i) const {
  const uint64_t h = mix64(mix64(mix64(seed_) + uint64_t(step)) + uint64_t(i));
  return h % (tokens_.size() - T_);
}

void Sampler::fill(int64_t step, int first, int count, int32_t* inputs, int32_t* targets) const {
  std::vector<int32_t> seq(size_t(T_) + 1);
  for (int j = 0; j < count; ++j) {
    tokens_.read(start(step, first + j), seq.size(), seq.data());
    std::copy(seq.begin(), seq.end() - 1, inputs + size_t(j) * T_);
    std::copy(seq.begin() + 1, seq.end(), targets + size_t(j) * T_);
  }
}

}  // namespace trn::data
