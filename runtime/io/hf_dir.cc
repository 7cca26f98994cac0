#include "runtime/io/hf_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>

#include "collectives/core/error.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/hf_config.h"
#include "runtime/io/input_file.h"
#include "runtime/io/safetensors.h"
#include "runtime/kernels/bf16.h"

namespace trn::io {
namespace {

using json = nlohmann::json;

constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kSingle = "model.safetensors";

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// IEEE half to float, exactly (every half is a float).
float from_f16(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: man x 2^-24, normalised
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    u = sign | (uint32_t(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// n elements of `dtype` at src (unaligned) as floats at dst.
void convert(const std::string& dtype, const char* src, float* dst, size_t n) {
  if (dtype == "F32") {
    std::memcpy(dst, src, n * sizeof(float));
  } else if (dtype == "BF16") {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = kernels::from_bf16(h);
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = from_f16(h);
    }
  }
}

// The directory's safetensors files and which holds each tensor.
struct Weights {
  std::string origin;  // the index's path or model.safetensors's, for errors
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorEntry*>> tensors;
};

Weights open_weights(const std::string& dir, const std::string& flag) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0)
    throw usage_error("{} {}: cannot read it: {}", flag, dir, std::strerror(errno));
  if (!S_ISDIR(st.st_mode))
    throw usage_error("{} {} is not a directory; give a Hugging Face model directory", flag, dir);
  Weights w;
  const std::string index = dir + "/" + kIndex;
  if (exists(index)) {
    w.origin = index;
    json j;
    try {
      j = json::parse(read_input_file(flag + " index", index));
    } catch (const json::exception& e) {
      throw usage_error("{} is not valid JSON: {}", index, e.what());
    }
    const auto wm = j.is_object() ? j.find("weight_map") : j.end();
    if (wm == j.end() || !wm->is_object() || wm->empty())
      throw usage_error("{} has no weight_map object naming each tensor's file", index);
    std::map<std::string, std::vector<std::string>> by_file;
    for (const auto& [name, file] : wm->items()) {
      if (!file.is_string() || file.get<std::string>().empty() ||
          file.get<std::string>().find('/') != std::string::npos || file.get<std::string>()[0] == '.')
        throw usage_error(
            "{}: weight_map gives tensor {} the file {}; a file name in the directory is needed", index, name,
            file.dump());
      by_file[file.get<std::string>()].push_back(name);
    }
    for (const auto& [file, names] : by_file) {
      const std::string path = dir + "/" + file;
      if (!exists(path))
        throw usage_error("{} {}: shard {} is missing; {} lists {} tensors in it (first {})", flag, dir, file,
                          kIndex, names.size(), names.front());
      w.files.push_back(std::make_unique<SafetensorsFile>(path, flag + " shard"));
      const SafetensorsFile& f = *w.files.back();
      for (const std::string& name : names) {
        const auto it = f.tensors().find(name);
        if (it == f.tensors().end())
          throw usage_error("{}: {} says shard {} holds tensor {}, but it does not", index, kIndex, file,
                            name);
        w.tensors[name] = {&f, &it->second};
      }
      for (const auto& [name, t] : f.tensors())
        if (!wm->contains(name))
          throw usage_error(
              "{}: shard {} holds tensor {}, which {} does not list; the index and its shards disagree",
              index, file, name, kIndex);
    }
    return w;
  }
  const std::string single = dir + "/" + kSingle;
  if (!exists(single))
    throw usage_error("{} {} holds neither {} nor {}; give a Hugging Face model directory", flag, dir,
                      kSingle, kIndex);
  w.origin = single;
  w.files.push_back(std::make_unique<SafetensorsFile>(single, flag + " weights"));
  for (const auto& [name, t] : w.files.back()->tensors()) w.tensors[name] = {w.files.back().get(), &t};
  return w;
}

}  // namespace

void load_hf(const std::string& dir, const model::ParamLayout& layout, float* params,
             const std::string& flag) {
  Weights w = open_weights(dir, flag);
  const model::ParamLayout full(layout.config());
  // Entries of Hugging Face files that are not parameters: a tied model's copy of the head
  // (older transformers wrote it), rotary frequency buffers.
  for (auto it = w.tensors.begin(); it != w.tensors.end();) {
    const bool extra = (it->first == "lm_head.weight" || ends_with(it->first, ".rotary_emb.inv_freq")) &&
                       !full.find_or_null(it->first);
    it = extra ? w.tensors.erase(it) : std::next(it);
  }
  // This rank's slices by name (a rank holding two pipeline chunks may hold the tied embedding twice).
  std::multimap<std::string, const model::TensorSpec*> mine;
  for (const model::TensorSpec& t : layout.tensors()) mine.emplace(t.name, &t);
  // In the Hugging Face order (embedding first), so the first mismatch reported is the most telling.
  for (auto spec_it = full.tensors().rbegin(); spec_it != full.tensors().rend(); ++spec_it) {
    const model::TensorSpec& spec = *spec_it;
    const auto it = w.tensors.find(spec.name);
    if (it == w.tensors.end())
      throw usage_error("{} {}: tensor {} is missing from {}; config.json describes a model that has it",
                        flag, dir, spec.name, w.origin);
    const SafetensorsFile& f = *it->second.first;
    const TensorEntry& t = *it->second.second;
    if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16")
      throw usage_error("{}: tensor {} has dtype {}; trn reads F32, BF16 and F16 weights", f.path(),
                        spec.name, t.dtype);
    if (t.shape != spec.global_shape)
      throw usage_error("{}: tensor {} has shape [{}] but config.json gives the model [{}]", f.path(),
                        spec.name, fmt::join(t.shape, ", "), fmt::join(spec.global_shape, ", "));
    const size_t es = t.dtype == "F32" ? 4 : 2;
    const char* src = f.data(t);
    const auto [first, last] = mine.equal_range(spec.name);
    for (auto m = first; m != last; ++m) {
      const model::TensorSpec& s = *m->second;
      float* dst = params + s.offset;
      std::fill(dst, dst + s.numel, 0.0f);  // padding rows stay zero
      model::for_each_run(s, [&](size_t l, size_t g, size_t n) {
        convert(t.dtype, src + g * es, dst + l, n);
        for (size_t i = 0; i < n; ++i)
          if (!std::isfinite(dst[l + i]))
            throw usage_error(
                "{}: tensor {} holds a non-finite value ({}) at element {}; the file is corrupt or "
                "comes from a diverged run",
                f.path(), spec.name, dst[l + i], g + i);
      });
    }
    f.release(t);
    w.tensors.erase(it);
  }
  if (!w.tensors.empty())
    throw usage_error(
        "{}: tensor {} is not a parameter of the model config.json describes ({} parameters expected)",
        w.tensors.begin()->second.first->path(), w.tensors.begin()->first, full.tensors().size());
}

namespace {

// Shard file names as transformers writes them.
std::string shard_name(size_t i, size_t n) {
  return n == 1 ? std::string(kSingle) : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
}

bool side_file(const std::string& name) {
  for (const char* s : kHfSideFiles)
    if (name == s) return true;
  return false;
}

// The names save_hf writes: a directory of only these (and config.json) is a previous output.
bool written_by_save_hf(const std::string& name) {
  static const std::regex shard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  return name == "config.json" || name == kSingle || name == kIndex || side_file(name) ||
         std::regex_match(name, shard);
}

std::string parent_of(const std::string& dir) {
  const auto slash = dir.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : dir.substr(0, slash);
}

std::string strip_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (const dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.emplace_back(e->d_name);
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

// One file of the temporary directory, written in pieces; errors name the destination (`shown`).
class Out {
 public:
  Out(const std::string& flag, const std::string& shown, const std::string& tmp, const std::string& name)
      : flag_(flag), shown_(shown), name_(name) {
    fd_ = ::open((tmp + "/" + name).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("create");
  }
  ~Out() {
    if (fd_ >= 0) ::close(fd_);
  }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;
  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("write");
      }
      p += w;
      n -= size_t(w);
    }
  }
  void close() {
    if (::fsync(fd_) != 0) fail("fsync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close");
  }

 private:
  [[noreturn]] void fail(const char* what) {
    const int err = errno;
    throw usage_error("cannot write {} {}: {} of {} failed: {}; nothing was written there", flag_, shown_,
                      what, name_, std::strerror(err));
  }
  std::string flag_, shown_, name_;
  int fd_ = -1;
};

void write_whole(const std::string& flag, const std::string& shown, const std::string& tmp,
                 const std::string& name, const std::string& bytes) {
  Out out(flag, shown, tmp, name);
  out.write(bytes.data(), bytes.size());
  out.close();
}

}  // namespace

void check_hf_output(const std::string& flag, const std::string& raw) {
  if (raw.empty()) throw usage_error("{} needs a directory", flag);
  const std::string dir = strip_slashes(raw);
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    const std::string parent = parent_of(dir);
    if (::stat(parent.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw usage_error("{} {}: directory {} does not exist; create it first", flag, raw, parent);
    if (::access(parent.c_str(), W_OK | X_OK) != 0)
      throw usage_error("{} {}: directory {} is not writable: {}", flag, raw, parent, std::strerror(errno));
    return;
  }
  if (!S_ISDIR(st.st_mode))
    throw usage_error("{} {} exists and is not a directory; give a directory", flag, raw);
  const std::vector<std::string> have = entries(dir);
  for (const std::string& name : have)
    if (!written_by_save_hf(name))
      throw usage_error(
          "{} {} already holds {}, which {} does not write; give a new or empty directory (a previous {} "
          "output is replaced whole, never mixed with)",
          flag, raw, name, flag, flag);
  if (!have.empty() && !std::count(have.begin(), have.end(), "config.json"))
    throw usage_error(
        "{} {} holds model files but no config.json, so it is no {} output; give a new or empty directory",
        flag, raw, flag);
  if (::access(parent_of(dir).c_str(), W_OK | X_OK) != 0)
    throw usage_error(
        "{} {}: its parent directory is not writable (the output is built beside it and renamed): {}", flag,
        raw, std::strerror(errno));
}

void save_hf(const std::string& raw_dir, const model::ParamLayout& whole, const float* params,
             const HfSave& opt, const std::string& flag) {
  if (!whole.whole()) throw internal_error("save_hf needs the whole model; gather the shards first");
  check_hf_output(flag, raw_dir);
  const std::string dir = strip_slashes(raw_dir);
  const size_t es = opt.bf16 ? 2 : 4;
  // Tensors in the Hugging Face state dict's order (embedding, layers 0..N, final norm), packed
  // greedily into files of at most shard_bytes.
  std::vector<const model::TensorSpec*> order;
  for (const auto& t : whole.tensors()) order.push_back(&t);
  std::reverse(order.begin(), order.end());
  std::vector<std::vector<const model::TensorSpec*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const auto* t : order) {
    const uint64_t bytes = t->numel * es;
    if (in_shard > 0 && in_shard + bytes > opt.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(t);
    in_shard += bytes;
    total += bytes;
  }
  const std::string source_config =
      opt.source_dir.empty() || !exists(opt.source_dir + "/config.json")
          ? std::string()
          : read_input_file("--init-hf config.json", opt.source_dir + "/config.json");

  // Built in a hidden sibling (same filesystem, so the rename is atomic), then put in place.
  const std::string base = dir.substr(dir.rfind('/') == std::string::npos ? 0 : dir.rfind('/') + 1);
  const std::string tmp = parent_of(dir) + "/." + base + ".tmp-hf." + std::to_string(::getpid());
  std::filesystem::remove_all(tmp);  // a leftover of an earlier process with this pid
  if (::mkdir(tmp.c_str(), 0755) != 0)
    throw usage_error("cannot write {} {}: mkdir {} failed: {}", flag, raw_dir, tmp, std::strerror(errno));
  try {
    json weight_map = json::object();
    std::vector<uint16_t> half;
    for (size_t s = 0; s < shards.size(); ++s) {
      const std::string name = shard_name(s, shards.size());
      json meta = {{"format", "pt"}};
      for (const auto& [k, v] : opt.metadata) meta[k] = v;
      json header = json::object();
      header["__metadata__"] = meta;
      size_t at = 0;
      for (const auto* t : shards[s]) {
        header[t->name] = {{"dtype", opt.bf16 ? "BF16" : "F32"},
                           {"shape", t->global_shape},
                           {"data_offsets", {at, at + t->numel * es}}};
        at += t->numel * es;
        weight_map[t->name] = name;
      }
      std::string h = header.dump();
      while (h.size() % 8 != 0) h += ' ';  // the data starts 8-byte aligned
      char len[8];
      for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((uint64_t(h.size()) >> (8 * i)) & 0xff);
      Out out(flag, raw_dir, tmp, name);
      out.write(len, 8);
      out.write(h.data(), h.size());
      // The data in the order the offsets above were given (the header's keys print sorted).
      for (const auto* t : shards[s]) {
        const float* p = params + t->offset;
        if (opt.bf16) {
          half.resize(t->numel);
          kernels::round_to_bf16(half.data(), p, t->numel);
          out.write(half.data(), t->numel * 2);
        } else {
          out.write(p, t->numel * 4);
        }
      }
      out.close();
    }
    if (shards.size() > 1) {
      const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};  // keys sorted
      write_whole(flag, raw_dir, tmp, kIndex, index.dump(2) + "\n");
    }
    write_whole(flag, raw_dir, tmp, "config.json",
                hf_config_json(whole.config(), opt.bf16 ? "bfloat16" : "float32", source_config));
    if (!opt.source_dir.empty())
      for (const char* side : kHfSideFiles)
        if (exists(opt.source_dir + "/" + side))
          write_whole(flag, raw_dir, tmp, side,
                      read_input_file("--init-hf file", opt.source_dir + "/" + side));
    fsync_dir(tmp);
    // Into place: a new name by rename; over an empty directory or a previous output (checked
    // above) by exchanging the two in one step, then removing the old one.
    if (::rename(tmp.c_str(), dir.c_str()) != 0) {
      if (errno != ENOTEMPTY && errno != EEXIST)
        throw usage_error("cannot write {} {}: rename {} failed: {}", flag, raw_dir, tmp,
                          std::strerror(errno));
      if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) != 0)
        throw usage_error("cannot write {} {}: exchanging it with {} failed: {}", flag, raw_dir, tmp,
                          std::strerror(errno));
    }
    std::filesystem::remove_all(tmp);  // the previous output, if any
    fsync_dir(parent_of(dir));
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove_all(tmp, ignored);
    throw;
  }
}

uint64_t parse_byte_size(const std::string& flag, const std::string& text) {
  static const std::regex re(R"(\s*([0-9]+(?:\.[0-9]+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*)",
                             std::regex::icase);
  std::smatch m;
  if (!std::regex_match(text, m, re))
    throw usage_error("{} takes a size such as 5GB, 500MB or 2GiB, got '{}'", flag, text);
  std::string unit = m[2].str();
  std::transform(unit.begin(), unit.end(), unit.begin(), ::toupper);
  const std::map<std::string, double> scale = {
      {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  const double bytes = std::stod(m[1].str()) * scale.at(unit);
  if (!(bytes >= 1) || bytes > 1e18)
    throw usage_error("{} {} is not a size between 1 byte and 1 EB", flag, text);
  return uint64_t(bytes);
}

uint64_t peak_rss_bytes() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

}  // namespace trn::io
