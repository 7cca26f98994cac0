#include "runtime/data/indexed.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "collectives/core/error.h"
#include "runtime/io/input_file.h"

namespace trn::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr size_t kHeader = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, S, D

// Bytes per element of a dtype code, 0 for an unknown code.
size_t element_size(int dtype) {
  switch (dtype) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    case 5: case 6: return 8;
    default: return 0;
  }
}

const char* dtype_name(int dtype) {
  switch (dtype) {
    case 1: return "uint8";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 6: return "float64";
    case 7: return "float32";
    case 8: return "uint16";
    default: return "unknown";
  }
}

template <typename T>
T load(const unsigned char* p) {  // the index is packed: fields are not aligned
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Token at element index i of a .bin mapped at base, widened (the value may be out of int32
// range for int64; callers check at open).
int64_t element(const unsigned char* base, int dtype, size_t i) {
  switch (dtype) {
    case 1: return base[i];
    case 2: return static_cast<int8_t>(base[i]);
    case 3: return load<int16_t>(base + 2 * i);
    case 8: return load<uint16_t>(base + 2 * i);
    case 4: return load<int32_t>(base + 4 * i);
    default: return load<int64_t>(base + 8 * i);
  }
}

void write_all(int fd, const void* p, size_t n, const std::string& path) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw usage_error("cannot write dataset file {}: {}", path, std::strerror(errno));
    }
    c += w;
    n -= size_t(w);
  }
}

int create_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw usage_error("cannot create dataset file {}: {}", path, std::strerror(errno));
  return fd;
}

// A read-only mapping of a whole file (empty files are not mapped).
struct FileMap {
  const unsigned char* data = nullptr;
  size_t size = 0;
  FileMap() = default;
  FileMap(const FileMap&) = delete;
  FileMap& operator=(const FileMap&) = delete;
  ~FileMap() {
    if (data) ::munmap(const_cast<unsigned char*>(data), size);
  }
  void open(const std::string& path) {
    const io::InputFile in("dataset file", path);  // refuses a FIFO before reading it
    size = in.size();
    if (size > 0) {
      void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, in.fd(), 0);
      if (p == MAP_FAILED) throw usage_error("cannot map dataset file {}: {}", path, std::strerror(errno));
      data = static_cast<const unsigned char*>(p);
    }
  }
};

}  // namespace

int dtype_for_vocab(int64_t vocab) { return vocab < 65500 ? 8 : 4; }

// ---- writer ----

struct IndexedWriter::State {
  std::string prefix, bin_tmp, idx_tmp;
  int64_t vocab = 0;
  int dtype = 8;
  int bin_fd = -1;
  std::vector<int32_t> sizes;
  std::vector<int64_t> pointers;
  int64_t offset = 0;  // bytes written to .bin
  size_t tokens = 0;
  bool finished = false;
  std::vector<unsigned char> buf;  // one document converted to the dtype
};

IndexedWriter::IndexedWriter(const std::string& prefix, int64_t vocab) : s_(std::make_unique<State>()) {
  if (vocab <= 0 || vocab > std::numeric_limits<int32_t>::max())
    throw usage_error("dataset {}: vocabulary size {} is not in 1..{}", prefix, vocab,
                      std::numeric_limits<int32_t>::max());
  s_->prefix = prefix;
  s_->vocab = vocab;
  s_->dtype = dtype_for_vocab(vocab);
  const std::string tail = ".tmp." + std::to_string(::getpid());
  s_->bin_tmp = prefix + ".bin" + tail;
  s_->idx_tmp = prefix + ".idx" + tail;
  s_->bin_fd = create_file(s_->bin_tmp);
}

IndexedWriter::~IndexedWriter() {
  if (!s_) return;
  if (s_->bin_fd >= 0) ::close(s_->bin_fd);
  if (!s_->finished) {
    ::unlink(s_->bin_tmp.c_str());
    ::unlink(s_->idx_tmp.c_str());
  }
}

void IndexedWriter::add_document(const int32_t* tokens, size_t n) {
  if (s_->finished) throw internal_error("dataset {}: add_document after finish", s_->prefix);
  if (n > size_t(std::numeric_limits<int32_t>::max()))
    throw usage_error("dataset {}: a document of {} tokens exceeds the format's int32 size", s_->prefix, n);
  const size_t es = element_size(s_->dtype);
  s_->buf.resize(n * es);
  for (size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= s_->vocab)
      throw usage_error("dataset {}: token {} of document {} is {}, outside the vocabulary 0..{}", s_->prefix, i,
                        s_->sizes.size(), tokens[i], s_->vocab - 1);
    if (s_->dtype == 8) {
      const uint16_t v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(&s_->buf[2 * i], &v, 2);
    } else {
      std::memcpy(&s_->buf[4 * i], &tokens[i], 4);
    }
  }
  write_all(s_->bin_fd, s_->buf.data(), s_->buf.size(), s_->bin_tmp);
  s_->sizes.push_back(static_cast<int32_t>(n));
  s_->pointers.push_back(s_->offset);
  s_->offset += int64_t(n * es);
  s_->tokens += n;
}

void IndexedWriter::finish() {
  if (s_->finished) return;
  const uint64_t S = s_->sizes.size(), D = S + 1;
  std::vector<unsigned char> idx;
  idx.reserve(kHeader + S * 12 + D * 8);
  auto put = [&](const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    idx.insert(idx.end(), c, c + n);
  };
  const uint8_t dtype = uint8_t(s_->dtype);
  put(kMagic, 9);
  put(&kVersion, 8);
  put(&dtype, 1);
  put(&S, 8);
  put(&D, 8);
  put(s_->sizes.data(), S * 4);
  put(s_->pointers.data(), S * 8);
  for (uint64_t d = 0; d < D; ++d) {  // one sequence per document
    const int64_t v = int64_t(d);
    put(&v, 8);
  }
  const int idx_fd = create_file(s_->idx_tmp);
  try {
    write_all(idx_fd, idx.data(), idx.size(), s_->idx_tmp);
  } catch (...) {
    ::close(idx_fd);
    throw;
  }
  if (::fsync(idx_fd) != 0 || ::fsync(s_->bin_fd) != 0) {
    const int e = errno;
    ::close(idx_fd);
    throw usage_error("cannot sync dataset {}: {}", s_->prefix, std::strerror(e));
  }
  ::close(idx_fd);
  ::close(s_->bin_fd);
  s_->bin_fd = -1;
  // .bin first: a reader that finds the .idx finds its .bin.
  const std::string bin = s_->prefix + ".bin", idxp = s_->prefix + ".idx";
  if (::rename(s_->bin_tmp.c_str(), bin.c_str()) != 0 || ::rename(s_->idx_tmp.c_str(), idxp.c_str()) != 0)
    throw usage_error("cannot rename dataset {} into place: {}", s_->prefix, std::strerror(errno));
  s_->finished = true;
  // The directory entries: fsync the directory so the renames survive a crash.
  const size_t slash = s_->prefix.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : s_->prefix.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

size_t IndexedWriter::documents() const { return s_->sizes.size(); }
size_t IndexedWriter::tokens() const { return s_->tokens; }

// ---- reader ----

struct IndexedDataset::Map {
  std::string prefix;
  FileMap idx, bin;
  int dtype = 0;
  size_t es = 0;
  size_t S = 0, D = 0;
  const unsigned char* sizes = nullptr;     // int32[S], unaligned
  const unsigned char* pointers = nullptr;  // int64[S], unaligned
  size_t tokens = 0;
  int32_t max_token = -1;
};

IndexedDataset::IndexedDataset() = default;
IndexedDataset::IndexedDataset(IndexedDataset&&) noexcept = default;
IndexedDataset& IndexedDataset::operator=(IndexedDataset&&) noexcept = default;
IndexedDataset::~IndexedDataset() = default;

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.m_ = std::make_unique<Map>();
  Map& m = *ds.m_;
  m.prefix = prefix;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  m.idx.open(idx_path);
  m.bin.open(bin_path);
  const unsigned char* p = m.idx.data;
  const size_t n = m.idx.size;
  if (n < 9 || std::memcmp(p, kMagic, 9) != 0)
    throw usage_error("dataset index {}: bad magic (expected \"MMIDIDX\\0\\0\"); not a Megatron indexed dataset",
                      idx_path);
  if (n < kHeader)
    throw usage_error("dataset index {}: {} bytes, shorter than the {}-byte header; the file is truncated", idx_path,
                      n, kHeader);
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != kVersion)
    throw usage_error("dataset index {}: version {} is not supported (expected 1)", idx_path, version);
  m.dtype = p[17];
  m.es = element_size(m.dtype);
  if (m.es == 0 || m.dtype == 6 || m.dtype == 7)
    throw usage_error("dataset index {}: dtype code {} ({}) is not a token type (expected 1-5 or 8)", idx_path,
                      m.dtype, dtype_name(m.dtype));
  const uint64_t S = load<uint64_t>(p + 18), D = load<uint64_t>(p + 26);
  // Exact size: header + sizes + pointers + doc_idx (counts above the file size cannot fit and
  // are rejected before the products could overflow).
  if (S > n || D > n || kHeader + S * 12 + D * 8 != n)
    throw usage_error("dataset index {}: {} bytes, but {} sequences and {} document indices need {}", idx_path, n, S,
                      D, S > n || D > n ? "more" : std::to_string(kHeader + S * 12 + D * 8));
  m.S = size_t(S);
  m.D = size_t(D);
  m.sizes = p + kHeader;
  m.pointers = m.sizes + 4 * m.S;
  const unsigned char* doc = m.pointers + 8 * m.S;
  // Sequences lie back to back in .bin: pointer i is the byte count of the sequences before it.
  uint64_t offset = 0;
  for (size_t i = 0; i < m.S; ++i) {
    const int32_t size = load<int32_t>(m.sizes + 4 * i);
    const int64_t ptr = load<int64_t>(m.pointers + 8 * i);
    if (size < 0) throw usage_error("dataset index {}: sequence {} has negative size {}", idx_path, i, size);
    if (ptr < 0 || uint64_t(ptr) != offset)
      throw usage_error("dataset index {}: sequence {} starts at byte {}, but the sizes before it end at byte {} "
                        "of {}",
                        idx_path, i, ptr, offset, bin_path);
    offset += uint64_t(size) * m.es;
  }
  if (offset != m.bin.size)
    throw usage_error("dataset index {}: its sizes add up to {} bytes of {}, but {} is {} bytes", idx_path, offset,
                      dtype_name(m.dtype), bin_path, m.bin.size);
  m.tokens = size_t(offset / m.es);
  if (m.D == 0) throw usage_error("dataset index {}: no document indices (expected at least doc_idx[0] = 0)", idx_path);
  int64_t prev = 0;
  for (size_t d = 0; d < m.D; ++d) {
    const int64_t v = load<int64_t>(doc + 8 * d);
    if ((d == 0 && v != 0) || v < prev || v > int64_t(m.S))
      throw usage_error("dataset index {}: document index {} is {}, out of order (expected 0 first, then "
                        "non-decreasing up to the sequence count {})",
                        idx_path, d, v, m.S);
    prev = v;
  }
  if (prev != int64_t(m.S))
    throw usage_error("dataset index {}: the last document index is {}, expected the sequence count {}", idx_path,
                      prev, m.S);
  // Token ids must be valid vocabulary indices: non-negative and in int32.
  int64_t mx = -1;
  for (size_t t = 0; t < m.tokens; ++t) {
    const int64_t v = element(m.bin.data, m.dtype, t);
    if (v < 0 || v > std::numeric_limits<int32_t>::max())
      throw usage_error("dataset {}: token {} is {}, not a vocabulary id", bin_path, t, v);
    if (v > mx) mx = v;
  }
  m.max_token = int32_t(mx);
  return ds;
}

const std::string& IndexedDataset::prefix() const { return m_->prefix; }
int IndexedDataset::dtype() const { return m_->dtype; }
size_t IndexedDataset::sequences() const { return m_->S; }
size_t IndexedDataset::documents() const { return m_->D - 1; }
size_t IndexedDataset::tokens() const { return m_->tokens; }
int32_t IndexedDataset::max_token() const { return m_->max_token; }
std::string_view IndexedDataset::bin_bytes() const {
  return {reinterpret_cast<const char*>(m_->bin.data), m_->bin.size};
}
std::string_view IndexedDataset::idx_bytes() const {
  return {reinterpret_cast<const char*>(m_->idx.data), m_->idx.size};
}

void IndexedDataset::read(size_t i, std::vector<int32_t>* out) const {
  TRN_CHECK(i < m_->S);
  const size_t size = size_t(load<int32_t>(m_->sizes + 4 * i));
  const size_t first = size_t(load<int64_t>(m_->pointers + 8 * i)) / m_->es;
  out->resize(size);
  for (size_t t = 0; t < size; ++t) (*out)[t] = int32_t(element(m_->bin.data, m_->dtype, first + t));
}

int32_t IndexedDataset::token(size_t t) const {
  TRN_CHECK(t < m_->tokens);
  return int32_t(element(m_->bin.data, m_->dtype, t));
}

void IndexedDataset::read_tokens(size_t first, size_t n, int32_t* out) const {
  TRN_CHECK(first <= m_->tokens && n <= m_->tokens - first);
  const unsigned char* b = m_->bin.data;
  switch (m_->dtype) {
    case 8:
      for (size_t t = 0; t < n; ++t) out[t] = load<uint16_t>(b + 2 * (first + t));
      break;
    case 4:
      std::memcpy(out, b + 4 * first, 4 * n);
      break;
    default:
      for (size_t t = 0; t < n; ++t) out[t] = int32_t(element(b, m_->dtype, first + t));
  }
}

}  // namespace trn::data
