#include "runtime/data/data.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "collectives/core/error.h"
#include "runtime/io/atomic_file.h"
#include "runtime/util/random.h"

namespace trn::data {
namespace {
constexpr int32_t kMagic = 20240520;
constexpr int kHeaderWords = 256;
}  // namespace

Tokens Tokens::from(std::vector<uint16_t> tokens, std::string source) {
  Tokens t;
  t.tokens_ = std::move(tokens);
  t.source_ = std::move(source);
  return t;
}

Tokens Tokens::load(const std::string& path, int vocab) {
  io::check_readable_file("--data", path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw usage_error("cannot read data file {}: {}; pass an existing --data FILE (raw text or "
                      "llm.c .bin), or leave --data out to use the built-in corpus",
                      path, std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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
    std::memcpy(tokens.data(), bytes.data() + sizeof header, count * 2);
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
  const uint16_t* tok = tokens_.data();
  for (int j = 0; j < count; ++j) {
    const size_t s = start(step, first + j);
    for (int t = 0; t < T_; ++t) {
      inputs[size_t(j) * T_ + t] = tok[s + t];
      targets[size_t(j) * T_ + t] = tok[s + t + 1];
    }
  }
}

}  // namespace trn::data
