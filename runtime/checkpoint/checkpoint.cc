#include "runtime/checkpoint/checkpoint.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/io/atomic_file.h"

namespace trn::checkpoint {
namespace {

constexpr const char* kFormat = "trn-checkpoint";
// Version 1: each shard holds whole local tensors. Version 2 (ZeRO-1): entries may hold a range
// of a local tensor's elements, and every rank writes a shard. Readers take both.
constexpr int kVersion = 1, kZeroVersion = 2;
using nlohmann::json;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error("cannot read checkpoint file {}", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

uint64_t hash(const void* p, size_t n) { return XXH64(p, n, 0); }

std::string shard_name(int rank) { return fmt::format("rank-{:05}.shard", rank); }

bool is_dir(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

void remove_tree(const std::string& p) {
  if (DIR* d = ::opendir(p.c_str())) {
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") ::unlink((p + "/" + n).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(p.c_str());
}

// Step directories under dir, oldest first.
std::vector<std::pair<int64_t, std::string>> step_dirs(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.size() == 13 && n.rfind("step-", 0) == 0 && std::all_of(n.begin() + 5, n.end(), ::isdigit))
      out.emplace_back(std::stoll(n.substr(5)), dir + "/" + n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

json parse_header(const std::string& bytes, const std::string& path, size_t* data_start) {
  if (bytes.size() < 8) throw usage_error("checkpoint shard {} is truncated ({} bytes)", path, bytes.size());
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(bytes[i]);
  if (len > bytes.size() - 8) throw usage_error("checkpoint shard {} is truncated: header of {} bytes", path, len);
  *data_start = 8 + len;
  try {
    return json::parse(std::string_view(bytes).substr(8, len));
  } catch (const std::exception& e) {
    throw usage_error("checkpoint shard {} has a corrupt header: {}", path, e.what());
  }
}

json read_manifest(const std::string& path) {
  const std::string m = path + "/manifest.json";
  json j;
  try {
    j = json::parse(read_all(m));
  } catch (const Error&) {
    throw usage_error("{} is not a committed checkpoint: {} is missing", path, m);
  } catch (const std::exception& e) {
    throw usage_error("{} is corrupt: {}", m, e.what());
  }
  const int version = j.value("version", 0);
  if (j.value("format", "") != kFormat || (version != kVersion && version != kZeroVersion))
    throw usage_error("{}: not a trn checkpoint manifest of version {} or {}", m, kVersion, kZeroVersion);
  return j;
}

}  // namespace

std::string step_dir(const std::string& dir, int64_t step) { return fmt::format("{}/step-{:08}", dir, step); }

std::string save(const std::string& dir, const State& st, const Layout& layout, const model::ParamLayout& lay,
                 const float* params, const float* m, const float* v, const parallel::Coords& me,
                 const std::shared_ptr<Communicator>& world, int keep, const ReportFn& report,
                 const Owned* owned) {
  const std::string out = step_dir(dir, st.step);
  const int rank = world ? world->rank() : 0, size = world ? world->size() : 1;
  if (rank == 0) {
    if (is_dir(out)) remove_tree(out);  // an uncommitted attempt at this step
    if (::mkdir(out.c_str(), 0755) != 0)
      throw usage_error("cannot create checkpoint directory {}: {}", out, std::strerror(errno));
  }
  if (world) world->barrier()->wait();
  struct FileInfo {
    uint64_t bytes = 0, hash = 0;
  } mine;
  const int version = owned ? kZeroVersion : kVersion;
  if (me.dp == 0 || owned) {
    json tensors = json::array();
    std::string data;
    // Elements [b, e) of tensor t, whose arrays start at `at` in params, m and v.
    auto add = [&](const model::TensorSpec& t, size_t b, size_t e, size_t at) {
      const size_t n = (e - b) * sizeof(float);
      json entry = {{"name", t.name}, {"global_shape", t.global_shape}, {"dim", t.shard_dim},
                    {"offset", t.shard_offset}, {"length", t.shard_length}, {"interleave", t.interleave},
                    {"numel", e - b}, {"data_offset", data.size()},
                    {"xxh64", {hash(params + at, n), hash(m + at, n), hash(v + at, n)}}};
      if (owned) entry["range"] = {b, e};
      tensors.push_back(entry);
      for (const float* a : {params, m, v}) data.append(reinterpret_cast<const char*>(a + at), n);
    };
    if (!owned) {
      for (const model::TensorSpec& t : lay.tensors()) add(t, 0, t.numel, t.offset);
    } else {
      size_t state = 0;  // where the range's elements start in the arrays
      for (const optim::Range& r : *owned) {
        for (const model::TensorSpec& t : lay.tensors()) {
          const size_t b = std::max(r.begin, t.offset), e = std::min(r.end, t.offset + t.numel);
          if (b < e) add(t, b - t.offset, e - t.offset, state + (b - r.begin));
        }
        state += r.size();
      }
    }
    const std::string header =
        json{{"format", kFormat}, {"version", version}, {"rank", rank}, {"tensors", tensors}}.dump();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((uint64_t(header.size()) >> (8 * i)) & 0xff);
    std::string file(len, 8);
    file += header;
    file += data;
    io::write_file_atomic(out + "/" + shard_name(rank), file);  // fsynced
    mine = {file.size(), hash(file.data(), file.size())};
  }
  if (report) report(st.step, mine.bytes ? out + "/" + shard_name(rank) : out, mine.bytes);
  std::vector<FileInfo> all(size);
  if (world) world->all_gather(&mine, all.data(), 2, DataType::kI64)->wait();
  else all[0] = mine;
  if (rank == 0) {
    json files = json::array();
    for (int r = 0; r < size; ++r)
      if (all[r].bytes) files.push_back({{"name", shard_name(r)}, {"bytes", all[r].bytes}, {"xxh64", all[r].hash}});
    json lj = {{"dp", layout.dp}, {"tp", layout.tp}, {"pp", layout.pp}, {"virtual_stages", layout.virtual_stages}};
    if (owned) lj["zero"] = 1;
    const json manifest = {{"format", kFormat},
                           {"version", version},
                           {"step", st.step},
                           {"optimizer_step", st.optimizer_step},
                           {"seed", st.seed},
                           {"layout", lj},
                           {"model", lay.config().describe()},
                           {"files", files}};
    io::write_file_atomic(out + "/manifest.json", manifest.dump(1));  // the commit marker
    // Keep the newest `keep` committed checkpoints; directories without a manifest are debris.
    auto dirs = step_dirs(dir);
    int committed = 0;
    for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
      const bool has_manifest = ::access((it->second + "/manifest.json").c_str(), F_OK) == 0;
      if (has_manifest && ++committed <= keep) continue;
      if (it->second != out) remove_tree(it->second);
    }
  }
  if (world) world->barrier()->wait();
  return out;
}

void verify(const std::string& path) {
  const json man = read_manifest(path);
  for (const auto& f : man.at("files")) {
    const std::string file = path + "/" + f.at("name").get<std::string>();
    struct stat st;
    if (::stat(file.c_str(), &st) != 0) throw usage_error("checkpoint {}: shard {} is missing", path, file);
    if (uint64_t(st.st_size) != f.at("bytes").get<uint64_t>())
      throw usage_error("checkpoint {}: shard {} has {} bytes, the manifest says {} (truncated?)", path, file,
                        st.st_size, f.at("bytes").get<uint64_t>());
    const std::string bytes = read_all(file);
    if (hash(bytes.data(), bytes.size()) != f.at("xxh64").get<uint64_t>())
      throw usage_error("checkpoint {}: shard {} fails its checksum (corrupted)", path, file);
  }
}

std::optional<std::string> latest(const std::string& dir) {
  auto dirs = step_dirs(dir);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (::access((it->second + "/manifest.json").c_str(), F_OK) != 0) continue;  // not committed
    try {
      verify(it->second);
      return it->second;
    } catch (const Error& e) {
      log::warn(log::Subsys::kTrain, "skipping checkpoint {}: {}", it->second, e.what());
    }
  }
  return std::nullopt;
}

std::vector<Entry> list(const std::string& dir) {
  if (!is_dir(dir)) throw usage_error("{} is not a directory", dir);
  std::vector<Entry> out;
  for (const auto& [step, path] : step_dirs(dir)) {
    Entry e;
    e.path = path;
    e.step = step;
    try {
      const json man = read_manifest(path);
      e.committed = true;
      e.model = man.value("model", "");
      const json& l = man.at("layout");
      e.layout = fmt::format("dp {} x tp {} x pp {} (virtual stages {}){}", l.value("dp", 1), l.value("tp", 1),
                             l.value("pp", 1), l.value("virtual_stages", 1),
                             l.value("zero", 0) ? fmt::format(", zero {}", l.value("zero", 0)) : "");
      for (const auto& f : man.at("files")) e.bytes += f.value("bytes", uint64_t{0});
    } catch (const Error&) {
      e.committed = false;
    }
    out.push_back(e);
  }
  return out;
}

model::Config model_of(const std::string& path) {
  const std::string d = read_manifest(path).value("model", "");
  model::Config c;
  if (std::sscanf(d.c_str(), "n_layer=%d n_head=%d d_model=%d ctx=%d vocab=%d", &c.n_layer, &c.n_head, &c.d_model,
                  &c.ctx, &c.vocab) != 5)
    throw usage_error("{}/manifest.json names no model it can read ('{}')", path, d);
  c.validate();
  return c;
}

State load(const std::string& path, const model::ParamLayout& lay, float* params, float* m, float* v,
           const Owned* owned) {
  const json man = read_manifest(path);
  if (man.value("model", "") != lay.config().describe())
    throw usage_error("checkpoint {} holds model {} but this run trains {}; pass the model flags it was saved with",
                      path, man.value("model", ""), lay.config().describe());
  // Each shard file's tensors, by name: the slices of the global tensors it holds.
  struct Piece {
    const std::string* bytes;
    size_t start;
    json t;
  };
  std::vector<std::string> files;
  std::map<std::string, std::vector<Piece>> pieces;
  files.reserve(man.at("files").size());
  for (const auto& f : man.at("files")) {
    const std::string file = path + "/" + f.at("name").get<std::string>();
    files.push_back(read_all(file));
    const std::string& bytes = files.back();
    if (bytes.size() != f.at("bytes").get<uint64_t>() || hash(bytes.data(), bytes.size()) != f.at("xxh64").get<uint64_t>())
      throw usage_error("checkpoint {}: shard {} is truncated or corrupted", path, file);
    size_t start = 0;
    const json h = parse_header(bytes, file, &start);
    for (const auto& t : h.at("tensors")) pieces[t.at("name").get<std::string>()].push_back({&bytes, start, t});
  }
  const model::ParamLayout full(lay.config());
  for (const model::TensorSpec& mine : lay.tensors()) {
    auto it = pieces.find(mine.name);
    if (it == pieces.end()) throw usage_error("checkpoint {} has no tensor {}", path, mine.name);
    const model::TensorSpec& g = full.find(mine.name);
    std::vector<float> global[3];
    for (auto& a : global) a.assign(g.numel, 0.0f);
    std::vector<float> covered(g.numel, 0.0f);  // 1 where a shard held the element
    for (const Piece& pc : it->second) {
      // The saved slice, described as this layout describes its own.
      model::TensorSpec saved;
      saved.name = mine.name;
      saved.global_shape = pc.t.at("global_shape").get<std::vector<int64_t>>();
      saved.shard_dim = pc.t.at("dim").get<int>();
      saved.shard_offset = pc.t.at("offset").get<int64_t>();
      saved.shard_length = pc.t.at("length").get<int64_t>();
      saved.interleave = pc.t.at("interleave").get<int>();
      const size_t count = pc.t.at("numel").get<size_t>();
      saved.shape = saved.global_shape;
      if (saved.shard_dim >= 0) saved.shape[saved.shard_dim] = saved.shard_length * saved.interleave;
      saved.numel = 1;
      for (int64_t d : saved.shape) saved.numel *= size_t(d);
      if (saved.global_shape != g.global_shape)
        throw usage_error("checkpoint {}: tensor {} has global shape of another model", path, mine.name);
      // A ZeRO-1 entry holds elements [first, first + count) of the saved slice; others all of it.
      size_t first = 0;
      const bool ranged = pc.t.contains("range");
      if (ranged) {
        const auto r = pc.t.at("range").get<std::vector<size_t>>();
        if (r.size() != 2 || r[0] > r[1] || r[1] > saved.numel || r[1] - r[0] != count)
          throw usage_error("checkpoint {}: tensor {} has a range outside its slice", path, mine.name);
        first = r[0];
      } else if (count != saved.numel) {
        throw usage_error("checkpoint {}: tensor {} holds {} elements, its slice has {}", path, mine.name, count,
                          saved.numel);
      }
      const size_t n = count * sizeof(float);
      const size_t at = pc.start + pc.t.at("data_offset").get<size_t>();
      if (at + 3 * n > pc.bytes->size()) throw usage_error("checkpoint {}: tensor {} runs past its shard", path, mine.name);
      const auto hashes = pc.t.at("xxh64").get<std::vector<uint64_t>>();
      for (int k = 0; k < 3; ++k) {
        const char* src = pc.bytes->data() + at + k * n;
        if (hash(src, n) != hashes.at(k)) throw usage_error("checkpoint {}: tensor {} fails its checksum", path, mine.name);
        std::vector<float> local(count);
        std::memcpy(local.data(), src, n);
        if (!ranged) {
          model::copy_to_global(saved, local.data(), global[k].data());
          continue;
        }
        for (size_t i = 0; i < count; ++i)
          if (const int64_t at = saved.global_index(first + i); at >= 0) global[k][size_t(at)] = local[i];
      }
      if (!ranged) {
        model::copy_to_global(saved, std::vector<float>(saved.numel, 1.0f).data(), covered.data());
      } else {
        for (size_t i = 0; i < count; ++i)
          if (const int64_t at = saved.global_index(first + i); at >= 0) covered[size_t(at)] = 1.0f;
      }
    }
    if (std::find(covered.begin(), covered.end(), 0.0f) != covered.end())
      throw usage_error("checkpoint {}: its shards leave part of tensor {} out (a shard file is missing)", path,
                        mine.name);
    model::copy_from_global(mine, global[0].data(), params + mine.offset);
    if (!owned) {
      model::copy_from_global(mine, global[1].data(), m + mine.offset);
      model::copy_from_global(mine, global[2].data(), v + mine.offset);
      continue;
    }
    // Only the owned elements of this tensor, to where the owned ranges keep them.
    std::vector<float> local[2];
    size_t state = 0;
    for (const optim::Range& r : *owned) {
      const size_t b = std::max(r.begin, mine.offset), e = std::min(r.end, mine.offset + mine.numel);
      if (b < e)
        for (int k = 0; k < 2; ++k) {
          if (local[k].empty()) {
            local[k].resize(mine.numel);
            model::copy_from_global(mine, global[1 + k].data(), local[k].data());
          }
          std::copy(local[k].begin() + (b - mine.offset), local[k].begin() + (e - mine.offset),
                    (k == 0 ? m : v) + state + (b - r.begin));
        }
      state += r.size();
    }
  }
  State st;
  st.step = man.at("step").get<int64_t>();
  st.optimizer_step = man.at("optimizer_step").get<int64_t>();
  st.seed = man.at("seed").get<uint64_t>();
  return st;
}

}  // namespace trn::checkpoint
