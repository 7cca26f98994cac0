#include "runtime/io/safetensors.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"


namespace trn::io {
namespace {

constexpr uint64_t kMaxHeader = 100u << 20;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Bytes per element of a safetensors dtype, 0 for a name the format does not define.
size_t dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, size_t> kBytes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  const auto it = kBytes.find(dtype);
  return it == kBytes.end() ? 0 : it->second;
}

// A tensor of a known dtype spans exactly its elements' bytes (the format's rule; a dtype the
// format does not define is left to the loader, which reads F32 only).
void check_size(const std::string& path, const std::string& name, const TensorEntry& t) {
  const size_t es = dtype_bytes(t.dtype);
  if (es == 0) return;
  uint64_t need = es;
  bool overflow = false;
  for (int64_t d : t.shape) {
    if (d != 0 && need > UINT64_MAX / uint64_t(d)) overflow = true;
    need *= uint64_t(d);
  }
  if (overflow || need != t.end - t.begin)
    throw usage_error("{} has a corrupt safetensors header: tensor {} has data_offsets [{}, {}] ({} bytes), but {} "
                      "[{}] needs {} bytes",
                      path, name, t.begin, t.end, t.end - t.begin, t.dtype, fmt::join(t.shape, ", "),
                      overflow ? std::string("more than 2^64") : std::to_string(need));
}

// The tensors' byte ranges, in order of offset, tile the data exactly: the first starts at 0,
// each starts where the one before it ends, and the last ends at the end of the file. This is
// the format's rule: no byte is shared by two tensors (a write to one would change another),
// and no byte belongs to none (a file cannot hide other content).
void check_tiling(const std::string& path, const std::map<std::string, TensorEntry>& tensors, size_t data_size) {
  std::vector<std::pair<const std::string*, const TensorEntry*>> order;
  for (const auto& [name, t] : tensors) order.emplace_back(&name, &t);
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) {  // ties in name order
    return std::pair(a.second->begin, a.second->end) < std::pair(b.second->begin, b.second->end);
  });
  size_t at = 0;
  const std::string* prev = nullptr;
  for (const auto& [name, t] : order) {
    if (t->begin < at)
      throw usage_error("{} has a corrupt safetensors header: tensor {} data_offsets [{}, {}] overlap tensor {}, "
                        "which ends at byte {}; every tensor needs bytes of its own",
                        path, *name, t->begin, t->end, *prev, at);
    if (t->begin > at)
      throw usage_error("{} has a corrupt safetensors header: tensor {} starts at byte {}, but the tensors before "
                        "it end at byte {}; the data must hold the tensors back to back, with no gap",
                        path, *name, t->begin, at);
    at = t->end;
    prev = name;
  }
  if (at != data_size)
    throw usage_error("{} has a corrupt safetensors header: its tensors end at byte {} of the {} bytes of data; "
                      "{} trailing bytes belong to no tensor",
                      path, at, data_size, data_size - at);
}

}  // namespace

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  const InputFile in("safetensors file", path);
  char len[8];
  if (in.size() < 8 || ::pread(in.fd(), len, 8, 0) != 8)
    throw usage_error("{} is not a safetensors file: shorter than the 8-byte header length", path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(len[i]);
  std::string header(header_len <= kMaxHeader ? header_len : 0, '\0');
  if (header_len > kMaxHeader || header_len > in.size() - 8 ||
      ::pread(in.fd(), header.data(), header.size(), 8) != ssize_t(header.size()))
    throw usage_error("{} has a corrupt safetensors header: header length {} does not fit the file", path,
                      header_len);
  std::map<std::string, std::string> out;
  const nlohmann::json h = nlohmann::json::parse(header, nullptr, false);
  if (h.is_discarded() || !h.is_object()) throw usage_error("{} has a corrupt safetensors header", path);
  if (const auto it = h.find("__metadata__"); it != h.end() && it->is_object())
    for (const auto& [k, v] : it->items())
      if (v.is_string()) out[k] = v.get<std::string>();
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path, const std::string& what) : path_(path) {
  const InputFile in(what, path);
  size_ = in.size();
  char len[8];
  if (size_ < 8 || ::pread(in.fd(), len, 8, 0) != 8)
    throw usage_error("{} is not a safetensors file: only {} bytes, shorter than the 8-byte header "
                      "length",
                      path, size_);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(len[i]);
  if (header_len > kMaxHeader || header_len > size_ - 8)
    throw usage_error("{} has a corrupt safetensors header: header length {} does not fit the {} "
                      "byte file; the file is truncated or not safetensors",
                      path, header_len, size_);
  // Read-only and private: the file's pages are shared with the page cache, and a page this
  // process never touches costs it nothing.
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, in.fd(), 0);
  if (m == MAP_FAILED) throw usage_error("cannot map {} {}: {}", what, path, std::strerror(errno));
  map_ = static_cast<const char*>(m);
  const std::string_view bytes(map_, size_);
  data_start_ = 8 + header_len;
  const size_t data_size = size_ - data_start_;
  // nlohmann::json parses what others wrote; every field is then checked for shape and range.
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, header_len));
  } catch (const std::exception& e) {
    unmap();
    throw usage_error("{} has a corrupt safetensors header: {}", path, e.what());
  }
  try {
    parse_header(header, data_size);
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

void SafetensorsFile::unmap() {
  if (map_) ::munmap(const_cast<char*>(map_), size_);
  map_ = nullptr;
}

void SafetensorsFile::release(const TensorEntry& t) const {
  const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t first = (uintptr_t(data(t)) / page) * page, end = uintptr_t(data(t)) + (t.end - t.begin);
  if (end > first) ::madvise(reinterpret_cast<void*>(first), end - first, MADV_DONTNEED);
}

void SafetensorsFile::parse_header(const nlohmann::json& header, size_t data_size) {
  const std::string& path = path_;
  if (!header.is_object()) throw usage_error("{} has a corrupt safetensors header: not a JSON object", path);
  for (const auto& item : header.items()) {
    // Named references, not a structured binding: the lambdas below capture them.
    const std::string& name = item.key();
    const nlohmann::json& v = item.value();
    if (name == "__metadata__") {
      if (v.is_object())
        for (const auto& [k, mv] : v.items())
          if (mv.is_string()) metadata_[k] = mv.get<std::string>();
      continue;
    }
    auto bad = [&](const char* what) {
      return usage_error("{} has a corrupt safetensors header: tensor {} {}", path, name, what);
    };
    if (!v.is_object()) throw bad("is not an object");
    auto field = [&](const char* key) -> const nlohmann::json* {
      auto it = v.find(key);
      return it == v.end() ? nullptr : &*it;
    };
    const nlohmann::json* dtype = field("dtype");
    const nlohmann::json* shape = field("shape");
    const nlohmann::json* offsets = field("data_offsets");
    if (!dtype || !dtype->is_string()) throw bad("has no dtype string");
    if (!shape || !shape->is_array()) throw bad("has no shape array");
    if (!offsets || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned())
      throw bad("has no [begin, end] data_offsets");
    TensorEntry t;
    t.dtype = dtype->get<std::string>();
    for (const auto& d : *shape) {
      if (!d.is_number_unsigned()) throw bad("has a shape entry that is not a size");
      t.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
    }
    t.begin = (*offsets)[0].get<uint64_t>();
    t.end = (*offsets)[1].get<uint64_t>();
    if (t.end < t.begin) throw bad("has data_offsets that are not an increasing range");
    if (t.end > data_size)
      throw usage_error("{} has a corrupt safetensors header: tensor {} data_offsets [{}, {}] lie "
                        "outside the {} bytes of data; the file is truncated",
                        path, name, t.begin, t.end, data_size);
    check_size(path, name, t);
    tensors_[name] = std::move(t);
  }
  check_tiling(path, tensors_, data_size);
}

void save_gpt2(const std::string& path, const model::ParamLayout& layout, const float* params,
               const std::map<std::string, std::string>& metadata) {
  if (!layout.whole()) throw internal_error("save_gpt2 needs the whole model; gather the shards first");
  // Tensors in the order of the Hugging Face state dict (embeddings, h.0 ... h.N, ln_f).
  std::vector<const model::TensorSpec*> order;
  for (const auto& t : layout.tensors()) order.push_back(&t);
  std::reverse(order.begin(), order.end());
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"";
  for (const auto& [k, v] : metadata)
    header += fmt::format(",{}:{}", nlohmann::json(k).dump(), nlohmann::json(v).dump());
  header += "}";
  size_t offset = 0;
  for (const auto* t : order) {
    const size_t bytes = t->numel * sizeof(float);
    header += fmt::format(",{}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          nlohmann::json(t->name).dump(), fmt::join(t->shape, ","), offset, offset + bytes);
    offset += bytes;
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) header += ' ';
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((uint64_t(header.size()) >> (8 * i)) & 0xff);
  std::string data;
  data.reserve(offset);
  for (const auto* t : order)
    data.append(reinterpret_cast<const char*>(params + t->offset), t->numel * sizeof(float));
  write_file_atomic(path, {std::string_view(len, 8), header, data});
}

void load_gpt2(const std::string& path, const model::ParamLayout& layout, float* params) {
  SafetensorsFile f(path);
  const model::ParamLayout full(layout.config());
  std::map<std::string, const TensorEntry*> by_name;
  for (const auto& [raw, t] : f.tensors()) {
    std::string name = raw.rfind("transformer.", 0) == 0 ? raw.substr(12) : raw;
    // Entries of Hugging Face files that are not parameters of this model: GPT-2's attention
    // masks and its copy of the tied head, Llama's rotary frequencies.
    const bool known_extra = ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias") ||
                             name == "lm_head.weight" || ends_with(name, ".rotary_emb.inv_freq");
    if (known_extra && !full.find_or_null(name)) continue;
    by_name[name] = &t;
  }
  // Every tensor of the whole model must be there, checked in the Hugging Face order (wte first)
  // so the first mismatch reported is the most telling one; this rank takes its slices.
  for (auto spec_it = full.tensors().rbegin(); spec_it != full.tensors().rend(); ++spec_it) {
    const model::TensorSpec& spec = *spec_it;
    auto it = by_name.find(spec.name);
    if (it == by_name.end())
      throw usage_error("{}: tensor {} is missing; the file holds a different model (pass the "
                        "--model / --n-layer flags it was saved with)",
                        path, spec.name);
    const TensorEntry& t = *it->second;
    if (t.dtype != "F32")
      throw usage_error("{}: tensor {} has dtype {}; trn reads F32 weights only", path, spec.name,
                        t.dtype);
    if (t.shape != spec.shape)
      throw usage_error("{}: tensor {} has shape [{}] but this model needs [{}]; pass the --model "
                        "/ --d-model / --ctx / --vocab flags the file was saved with",
                        path, spec.name, fmt::join(t.shape, ", "), fmt::join(spec.shape, ", "));
    if (t.end - t.begin != spec.numel * sizeof(float))
      throw usage_error("{} has a corrupt safetensors header: tensor {} spans {} bytes, its shape "
                        "needs {}",
                        path, spec.name, t.end - t.begin, spec.numel * sizeof(float));
    // Copied out: a file whose header length is not a multiple of 4 leaves the data misaligned.
    std::vector<float> copy(spec.numel);
    std::memcpy(copy.data(), f.data(t), spec.numel * sizeof(float));
    const float* values = copy.data();
    for (size_t i = 0; i < spec.numel; ++i)
      if (!std::isfinite(values[i]))
        throw usage_error("{}: tensor {} holds a non-finite value ({}) at element {}; the file is corrupt or "
                          "comes from a diverged run",
                          path, spec.name, values[i], i);
    if (const model::TensorSpec* mine = layout.find_or_null(spec.name))
      model::copy_from_global(*mine, values, params + mine->offset);
    by_name.erase(it);
  }
  if (!by_name.empty())
    throw usage_error("{}: tensor {} is not a parameter of this model ({}); pass the model flags "
                      "the file was saved with",
                      path, by_name.begin()->first,
                      fmt::format("{} parameters expected", full.tensors().size()));
}

}  // namespace trn::io
