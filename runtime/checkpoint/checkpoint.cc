#include "runtime/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"

namespace trn::checkpoint {
namespace {

// isdigit over a char of a name read from disk (plain char may be negative).
bool is_digit(char c) { return c >= '0' && c <= '9'; }


constexpr const char* kFormat = "trn-checkpoint";
// Version 1: each shard holds whole local tensors. Version 2 (ZeRO-1): entries may hold a range
// of a local tensor's elements, and every rank writes a shard. Readers take both.
// Version 3: the manifest also names its run ("run_id") and the settings a resume must match;
// shard files stay version 1 or 2.
constexpr int kVersion = 1, kZeroVersion = 2, kRunVersion = 3;
using nlohmann::json;

// A checkpoint file, whole; a usage error naming it when it is missing or not a regular file.
std::string read_all(const std::string& path) { return io::read_input_file("checkpoint file", path); }

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
    if (n.size() == 13 && n.rfind("step-", 0) == 0 && std::all_of(n.begin() + 5, n.end(), is_digit))
      out.emplace_back(std::stoll(n.substr(5)), dir + "/" + n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// A usage error for a damaged checkpoint file: "damaged checkpoint FILE: field F: what".
template <typename... Args>
Error damaged(const std::string& file, const std::string& field, fmt::format_string<Args...> f, Args&&... args) {
  return usage_error("damaged checkpoint {}: field \"{}\" {}", file, field,
                     fmt::format(f, std::forward<Args>(args)...));
}

// Typed, range-checked reads of one JSON field; `file` and `field` name it in the error.
// `name` may carry a path for the message ("files[0].bytes"): the key is what follows its last dot.
const json& field(const json& obj, const std::string& file, const std::string& name) {
  if (!obj.is_object()) throw damaged(file, name, "cannot be read: its parent is not a JSON object");
  const auto dot = name.find_last_of('.');
  auto it = obj.find(dot == std::string::npos ? name : name.substr(dot + 1));
  if (it == obj.end()) throw damaged(file, name, "is missing");
  return *it;
}

int64_t get_int(const json& v, const std::string& file, const std::string& name, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) throw damaged(file, name, "is not an integer (got {})", v.dump());
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
    throw damaged(file, name, "is {}, outside [{}, {}]", v.dump(), lo, hi);
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) throw damaged(file, name, "is {}, outside [{}, {}]", x, lo, hi);
  return x;
}
int64_t int_field(const json& obj, const std::string& file, const std::string& name, int64_t lo, int64_t hi) {
  return get_int(field(obj, file, name), file, name, lo, hi);
}
uint64_t get_u64(const json& v, const std::string& file, const std::string& name) {
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
    throw damaged(file, name, "is not a non-negative integer (got {})", v.dump());
  return v.get<uint64_t>();
}
uint64_t u64_field(const json& obj, const std::string& file, const std::string& name) {
  return get_u64(field(obj, file, name), file, name);
}
std::string string_field(const json& obj, const std::string& file, const std::string& name) {
  const json& v = field(obj, file, name);
  if (!v.is_string()) throw damaged(file, name, "is not a string (got {})", v.dump());
  return v.get<std::string>();
}
const json& array_field(const json& obj, const std::string& file, const std::string& name) {
  const json& v = field(obj, file, name);
  if (!v.is_array()) throw damaged(file, name, "is not an array (got a {})", v.type_name());
  return v;
}

json parse_header(const std::string& bytes, const std::string& path, size_t* data_start) {
  if (bytes.size() < 8) throw usage_error("checkpoint shard {} is truncated ({} bytes)", path, bytes.size());
  uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = (len << 8) | static_cast<unsigned char>(bytes[i]);
  if (len > bytes.size() - 8) throw usage_error("checkpoint shard {} is truncated: header of {} bytes", path, len);
  *data_start = 8 + len;
  json h;
  try {
    h = json::parse(std::string_view(bytes).substr(8, len));
  } catch (const std::exception& e) {
    throw usage_error("damaged checkpoint {}: corrupt header: {}", path, e.what());
  }
  if (!h.is_object()) throw usage_error("damaged checkpoint {}: its header is not a JSON object", path);
  if (string_field(h, path, "format") != kFormat) throw damaged(path, "format", "is not \"{}\"", kFormat);
  int_field(h, path, "version", kVersion, kZeroVersion);
  return h;
}

// The manifest, every field checked (not the files it names).
json read_manifest(const std::string& path) {
  const std::string m = path + "/manifest.json";
  json j;
  try {
    j = json::parse(read_all(m));
  } catch (const Error&) {
    if (::access(m.c_str(), F_OK) == 0) throw;  // there, but not a readable regular file
    throw usage_error("{} is not a committed checkpoint: {} is missing", path, m);
  } catch (const std::exception& e) {
    throw usage_error("damaged checkpoint {}: not valid JSON: {}", m, e.what());
  }
  if (!j.is_object()) throw usage_error("damaged checkpoint {}: the manifest is a JSON {}, not an object", m, j.type_name());
  if (string_field(j, m, "format") != kFormat) throw damaged(m, "format", "is not \"{}\"", kFormat);
  const int64_t version = int_field(j, m, "version", kVersion, kRunVersion);
  const int64_t step = int_field(j, m, "step", 0, INT64_MAX / 2);
  // The directory's name carries the step too: they must agree.
  std::string base = path;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  base = base.substr(base.find_last_of('/') + 1);
  if (base.size() > 5 && base.rfind("step-", 0) == 0 && std::all_of(base.begin() + 5, base.end(), is_digit) &&
      (base.size() > 23 || std::stoll(base.substr(5)) != step))
    throw damaged(m, "step", "is {} but the directory is {}", step, base);
  int_field(j, m, "optimizer_step", 0, step);
  u64_field(j, m, "seed");
  const json& l = field(j, m, "layout");
  if (!l.is_object()) throw damaged(m, "layout", "is not an object (got a {})", l.type_name());
  for (const char* k : {"dp", "tp", "pp", "virtual_stages"}) int_field(l, m, std::string("layout.") + k, 1, 1 << 24);
  if (l.contains("zero")) get_int(l.at("zero"), m, "layout.zero", 0, 3);
  if (l.contains("shard_group")) get_int(l.at("shard_group"), m, "layout.shard_group", 1, 1 << 24);
  string_field(j, m, "model");
  const json& files = array_field(j, m, "files");
  std::vector<std::string> names;
  for (size_t i = 0; i < files.size(); ++i) {
    const json& f = files[i];
    const std::string at = fmt::format("files[{}]", i);
    if (!f.is_object()) throw damaged(m, at, "is not an object (got a {})", f.type_name());
    const std::string name = string_field(f, m, at + ".name");
    // Only this directory's shard files: a name is never a path.
    if (name.size() != 16 || name.rfind("rank-", 0) != 0 || name.substr(10) != ".shard" ||
        !std::all_of(name.begin() + 5, name.begin() + 10, is_digit))
      throw damaged(m, at + ".name", "is \"{}\", not a shard file name rank-NNNNN.shard", name);
    if (std::find(names.begin(), names.end(), name) != names.end()) throw damaged(m, at + ".name", "repeats {}", name);
    names.push_back(name);
    u64_field(f, m, at + ".bytes");
    u64_field(f, m, at + ".xxh64");
  }
  // Required from kRunVersion on; an older manifest may still carry them, and state_of() reads
  // them whenever they are there.
  if (version >= kRunVersion || j.contains("run_id")) {
    const std::string run_id = string_field(j, m, "run_id");  // a string wherever it is
    if (run_id.empty() && version >= kRunVersion) throw damaged(m, "run_id", "is empty");
  }
  if (version >= kRunVersion || j.contains("settings")) {
    const json& st = field(j, m, "settings");
    if (!st.is_object()) throw damaged(m, "settings", "is not an object (got a {})", st.type_name());
    for (const auto& [k, v] : st.items())
      if (!v.is_string()) throw damaged(m, "settings." + k, "is not a string (got {})", v.dump());
  }
  return j;
}

// The model a checked manifest names: exactly the description model::Config writes, of any
// family.
model::Config parse_model(const json& man, const std::string& path) {
  const std::string m = path + "/manifest.json";
  const std::string d = man.at("model").get<std::string>();
  try {
    return model::parse_config(d);
  } catch (const Error& e) {
    throw damaged(m, "model", "\"{}\" is not a model trn trains: {}", d, e.what());
  }
}

State state_of(const json& man) {
  State st;
  st.step = man.at("step").get<int64_t>();
  st.optimizer_step = man.at("optimizer_step").get<int64_t>();
  st.seed = man.at("seed").get<uint64_t>();
  if (man.contains("run_id")) st.run_id = man.at("run_id").get<std::string>();
  if (man.contains("settings"))
    for (const auto& [k, v] : man.at("settings").items()) st.settings.emplace_back(k, v.get<std::string>());
  else
    st.settings.emplace_back("--seed", std::to_string(st.seed));
  return st;
}

// One tensor entry of a shard, checked: the slice it holds and where its arrays are.
struct Piece {
  const std::string* bytes;
  std::string file;
  model::TensorSpec saved;  // the saved slice, described as a layout describes its own
  bool ranged = false;
  size_t first = 0, count = 0;  // elements [first, first + count) of the slice (all of it unranged)
  size_t at = 0;                // the first array's byte offset in *bytes
};

struct Checked {
  json manifest;
  State state;
  model::Config model;
  std::vector<std::string> files;  // every shard's bytes
  std::map<std::string, std::vector<Piece>> pieces;  // by tensor name
};

// Checks one header entry against the model's global tensor g and the shard's data.
Piece check_entry(const json& t, const std::string& file, const std::string& name, const model::TensorSpec& g,
                  const std::string& bytes, size_t start) {
  Piece pc;
  pc.bytes = &bytes;
  pc.file = file;
  model::TensorSpec& s = pc.saved;
  s.name = name;
  const std::string f = name + ".";
  const json& gs = array_field(t, file, f + "global_shape");
  for (const json& d : gs) s.global_shape.push_back(get_int(d, file, f + "global_shape", 1, INT32_MAX));
  if (s.global_shape != g.global_shape)
    throw damaged(file, f + "global_shape", "is {}, the model's tensor has {}", gs.dump(), json(g.global_shape).dump());
  const int ndim = int(s.global_shape.size());
  s.shard_dim = int(int_field(t, file, f + "dim", -1, ndim - 1));
  s.interleave = int(int_field(t, file, f + "interleave", 1, 64));
  s.shape = s.global_shape;
  if (s.shard_dim >= 0) {
    const int64_t g_dim = s.global_shape[size_t(s.shard_dim)];
    if (g_dim % s.interleave != 0)
      throw damaged(file, f + "interleave", "is {}, which does not divide dimension {} ({})", s.interleave, s.shard_dim,
                    g_dim);
    const int64_t part = g_dim / s.interleave;
    // Rows past the end of an uninterleaved dim-0 split are padding (a padded vocabulary);
    // everywhere else a slice lies inside its part.
    const bool padded = s.shard_dim == 0 && s.interleave == 1;
    s.shard_offset = int_field(t, file, f + "offset", 0, padded ? g_dim : part - 1);
    s.shard_length = int_field(t, file, f + "length", 1, padded ? 2 * g_dim : part - s.shard_offset);
    s.shape[size_t(s.shard_dim)] = s.shard_length * s.interleave;
  } else {
    if (s.interleave != 1) throw damaged(file, f + "interleave", "is {} for an unsplit tensor", s.interleave);
  }
  s.numel = 1;
  for (int64_t d : s.shape) s.numel *= size_t(d);  // each factor is below 2^32 and there are at most 2
  const size_t data = bytes.size() - start;
  pc.count = size_t(int_field(t, file, f + "numel", 0, int64_t(data / (3 * sizeof(float)))));
  if (t.contains("range")) {
    const json& r = t.at("range");
    if (!r.is_array() || r.size() != 2) throw damaged(file, f + "range", "is not a pair [b, e) (got {})", r.dump());
    const int64_t b = get_int(r[0], file, f + "range", 0, int64_t(s.numel));
    const int64_t e = get_int(r[1], file, f + "range", b, int64_t(s.numel));
    if (size_t(e - b) != pc.count)
      throw damaged(file, f + "range", "[{}, {}) holds {} elements, \"numel\" says {}", b, e, e - b, pc.count);
    pc.ranged = true;
    pc.first = size_t(b);
  } else if (pc.count != s.numel) {
    throw damaged(file, f + "numel", "is {}, the slice has {} elements", pc.count, s.numel);
  }
  const size_t n = pc.count * sizeof(float);
  const size_t off = size_t(int_field(t, file, f + "data_offset", 0, int64_t(data)));
  if (3 * n > data - off) throw damaged(file, f + "data_offset", "{} puts the tensor's arrays past the end of the file", off);
  pc.at = start + off;
  const json& hashes = array_field(t, file, f + "xxh64");
  if (hashes.size() != 3) throw damaged(file, f + "xxh64", "holds {} hashes, not 3", hashes.size());
  for (int k = 0; k < 3; ++k)
    if (hash(bytes.data() + pc.at + k * n, n) != get_u64(hashes[size_t(k)], file, f + "xxh64"))
      throw usage_error("damaged checkpoint {}: tensor {} fails its checksum", file, name);
  return pc;
}

// The one validation verify() and load() share (see the header).
Checked check(const std::string& path) {
  Checked c;
  c.manifest = read_manifest(path);
  c.state = state_of(c.manifest);
  c.model = parse_model(c.manifest, path);
  const json& files = c.manifest.at("files");
  uint64_t total = 0;
  for (const json& f : files) total += f.at("bytes").get<uint64_t>();
  // Each global element is stored at least once (a parameter and its two moments): a model whose
  // parameters alone would not fit in these files is not in them (checked before anything
  // model-sized is allocated; the coverage check below is the exact one).
  const model::ParamLayout full(c.model);
  if (double(full.total()) * sizeof(float) > double(total))
    throw usage_error("damaged checkpoint {}: its shards hold {} bytes, too few for model {} (a shard file is missing)",
                      path + "/manifest.json", total, c.model.describe());
  c.files.reserve(files.size());
  for (const json& f : files) {
    const std::string file = path + "/" + f.at("name").get<std::string>();
    struct stat st;
    if (::stat(file.c_str(), &st) != 0) throw usage_error("checkpoint {}: shard {} is missing", path, file);
    const uint64_t want = f.at("bytes").get<uint64_t>();
    if (uint64_t(st.st_size) != want)
      throw usage_error("checkpoint {}: shard {} has {} bytes, the manifest says {} (truncated?)", path, file,
                        st.st_size, want);
    c.files.push_back(read_all(file));
    const std::string& bytes = c.files.back();
    if (bytes.size() != want || hash(bytes.data(), bytes.size()) != f.at("xxh64").get<uint64_t>())
      throw usage_error("checkpoint {}: shard {} fails its checksum (corrupted)", path, file);
    size_t start = 0;
    const json h = parse_header(bytes, file, &start);
    const std::string name = f.at("name").get<std::string>();
    if (int_field(h, file, "rank", 0, INT32_MAX) != std::stoll(name.substr(5, 5)))
      throw damaged(file, "rank", "is {}, the file is {}", h.at("rank").dump(), name);
    const json& tensors = array_field(h, file, "tensors");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const json& t = tensors[i];
      if (!t.is_object()) throw damaged(file, fmt::format("tensors[{}]", i), "is not an object");
      const std::string tname = string_field(t, file, fmt::format("tensors[{}].name", i));
      const model::TensorSpec* g = full.find_or_null(tname);
      if (!g) throw damaged(file, fmt::format("tensors[{}].name", i), "is {}, not a tensor of model {}", tname,
                            c.model.describe());
      c.pieces[tname].push_back(check_entry(t, file, tname, *g, bytes, start));
    }
  }
  // Every global element of every tensor is held by some shard.
  for (const model::TensorSpec& g : full.tensors()) {
    std::vector<char> covered(g.numel, 0);
    auto it = c.pieces.find(g.name);
    if (it != c.pieces.end())
      for (const Piece& pc : it->second) {
        if (!pc.ranged) {
          std::vector<float> ones(pc.saved.numel, 1.0f), global(g.numel, 0.0f);
          model::copy_to_global(pc.saved, ones.data(), global.data());
          for (size_t i = 0; i < g.numel; ++i) covered[i] |= global[i] != 0.0f;
          continue;
        }
        for (size_t i = 0; i < pc.count; ++i)
          if (const int64_t at = pc.saved.global_index(pc.first + i); at >= 0) covered[size_t(at)] = 1;
      }
    if (std::find(covered.begin(), covered.end(), 0) != covered.end())
      throw usage_error("checkpoint {}: its shards leave part of tensor {} out (a shard file is missing)", path, g.name);
  }
  return c;
}

}  // namespace

std::string step_dir(const std::string& dir, int64_t step) { return fmt::format("{}/step-{:08}", dir, step); }

std::string save(const std::string& dir, const State& st, const parallel::Plan& plan, const model::ParamLayout& lay,
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
  // Replica 0 writes the model; under ZeRO every rank of the first shard group its owned ranges
  // (the other shard groups hold the same ranges: hybrid sharding). The replicas are the dp x cp
  // ranks of equal (tp, pp), member dp * cp + cp of the gradients' group.
  // Under expert parallelism the ep ranks of expert group 0 write, each its experts and rank 0 of
  // them the rest; with ZeRO every replica does (the shard group of each expert rank, whose
  // members own the slices: Plan::dp_shard).
  const int replica = me.dp * plan.cp + me.cp;
  const bool experts_only = plan.ep_rank(replica) != 0;
  if (owned ? (plan.ep > 1 || replica < plan.dp_shard()) : plan.ep_group(replica) == 0) {
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
      for (const model::TensorSpec& t : lay.tensors())
        if (t.expert || !experts_only) add(t, 0, t.numel, t.offset);
    } else {
      size_t state = 0;  // where the range's elements start in the arrays
      for (const optim::Range& r : *owned) {
        for (const model::TensorSpec& t : lay.tensors()) {
          const size_t b = std::max(r.begin, t.offset), e = std::min(r.end, t.offset + t.numel);
          if (b < e && (t.expert || !experts_only)) add(t, b - t.offset, e - t.offset, state + (b - r.begin));
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
    json lj = {{"dp", plan.dp}, {"tp", plan.tp}, {"pp", plan.pp}, {"virtual_stages", plan.virtual_stages}};
    if (plan.cp > 1) lj["cp"] = plan.cp;  // informational: the state does not depend on it
    if (plan.ep > 1) lj["ep"] = plan.ep;  // informational: every expert is saved by name
    if (owned) lj["zero"] = std::max(1, plan.zero_stage());  // informational: every stage saves owned ranges
    if (owned && plan.dp_replicate() > 1) lj["shard_group"] = plan.dp_shard();
    json settings = json::object();
    for (const auto& [k, v] : st.settings) settings[k] = v;
    const json manifest = {{"format", kFormat},
                           {"version", kRunVersion},
                           {"run_id", st.run_id},
                           {"settings", settings},
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

State verify(const std::string& path) { return check(path).state; }

std::optional<std::string> latest(const std::string& dir, const std::string* run_id) {
  auto dirs = step_dirs(dir);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) {
    if (::access((it->second + "/manifest.json").c_str(), F_OK) != 0) continue;  // not committed
    if (run_id) {  // another run's is passed over without reading its shards, damaged or not
      json man;  // an unreadable manifest stays null: verify() below says what is wrong with it
      try {
        man = json::parse(read_all(it->second + "/manifest.json"), nullptr, false);
      } catch (const Error&) {
      }
      if (man.is_object() && !(man.contains("run_id") && man["run_id"].is_string() && man["run_id"] == *run_id))
        continue;
    }
    try {
      const State st = verify(it->second);
      if (run_id && st.run_id != *run_id) continue;  // another run's
      return it->second;
    } catch (const Error& e) {
      log::warn(log::Subsys::kTrain, "skipping checkpoint {}: {}", it->second, e.what());
    }
  }
  return std::nullopt;
}

std::optional<std::string> newest_committed(const std::string& dir) {
  auto dirs = step_dirs(dir);
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it)
    if (::access((it->second + "/manifest.json").c_str(), F_OK) == 0) return it->second;
  return std::nullopt;
}

namespace {

std::string read_fd(int fd) {
  std::string out;
  char buf[512];
  ssize_t n;
  ::lseek(fd, 0, SEEK_SET);
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, size_t(n));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out;
}

}  // namespace

DirLock::DirLock(const std::string& dir, const std::string& run_id, double wait_same_run_s) {
  const std::string path = dir + "/.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw usage_error("cannot open the checkpoint directory's lock {}: {}", path, std::strerror(errno));
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_same_run_s);
  while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string holder = read_fd(fd_);  // "host H pid P run R"
    const bool same_run = holder.size() > run_id.size() + 5 && holder.substr(holder.size() - run_id.size()) == run_id &&
                          holder.substr(holder.size() - run_id.size() - 5, 5) == " run ";
    if (err != EWOULDBLOCK || !same_run || std::chrono::steady_clock::now() >= until) {
      ::close(fd_);
      fd_ = -1;
      if (err != EWOULDBLOCK) throw usage_error("cannot lock {}: {}", path, std::strerror(err));
      throw usage_error("--checkpoint-dir {} is in use by another job ({}{}): give this job another directory, or stop "
                        "that one first",
                        dir, holder.empty() ? "holder unknown" : holder,
                        same_run ? "; it is of this run and did not exit" : "");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string me = fmt::format("host {} pid {} run {}\n", host, ::getpid(), run_id);
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) != ssize_t(me.size()))
    log::warn(log::Subsys::kTrain, "cannot write the holder into {}: {}", path, std::strerror(errno));
}

DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::vector<Entry> list(const std::string& dir) {
  if (!is_dir(dir)) throw usage_error("{} is not a directory", dir);
  std::vector<Entry> out;
  for (const auto& [step, path] : step_dirs(dir)) {
    Entry e;
    e.path = path;
    e.step = step;
    // Committed means it has a manifest; one that does not check out is still listed as one
    // (verify says what is wrong with it).
    e.committed = ::access((path + "/manifest.json").c_str(), F_OK) == 0;
    try {
      const json man = read_manifest(path);
      e.model = man.value("model", "");
      const json& l = man.at("layout");
      e.layout = fmt::format("dp {} x tp {} x pp {} (virtual stages {}){}", l.value("dp", 1), l.value("tp", 1),
                             l.value("pp", 1), l.value("virtual_stages", 1),
                             l.value("zero", 0) ? fmt::format(", zero {}", l.value("zero", 0)) : "");
      if (l.contains("shard_group")) e.layout += fmt::format(", shard group {}", l.value("shard_group", 0));
      if (l.contains("ep")) e.layout += fmt::format(", ep {}", l.value("ep", 1));
      for (const auto& f : man.at("files")) e.bytes += f.value("bytes", uint64_t{0});
    } catch (const Error&) {
      e.model = "(damaged manifest)";
    }
    out.push_back(e);
  }
  return out;
}

model::Config model_of(const std::string& path) { return parse_model(read_manifest(path), path); }

State load(const std::string& path, const model::ParamLayout& lay, float* params, float* m, float* v,
           const Owned* owned, optim::Storage params_storage) {
  const bool compact = params_storage == optim::Storage::kCompact;
  TRN_CHECK(!compact || owned);
  {
    const json man = read_manifest(path);
    if (man.at("model").get<std::string>() != lay.config().describe())
      throw usage_error("checkpoint {} holds model {} but this run trains {}; pass the model flags it was saved with",
                        path, man.at("model").get<std::string>(), lay.config().describe());
  }
  const Checked c = check(path);
  const model::ParamLayout full(lay.config());
  for (const model::TensorSpec& mine : lay.tensors()) {
    const model::TensorSpec& g = full.find(mine.name);
    std::vector<float> global[3];
    for (auto& a : global) a.assign(g.numel, 0.0f);
    for (const Piece& pc : c.pieces.at(mine.name)) {  // check() saw every tensor covered
      const size_t n = pc.count * sizeof(float);
      std::vector<float> local(pc.count);
      for (int k = 0; k < 3; ++k) {
        std::memcpy(local.data(), pc.bytes->data() + pc.at + k * n, n);
        if (!pc.ranged) {
          model::copy_to_global(pc.saved, local.data(), global[k].data());
          continue;
        }
        for (size_t i = 0; i < pc.count; ++i)
          if (const int64_t at = pc.saved.global_index(pc.first + i); at >= 0) global[k][size_t(at)] = local[i];
      }
    }
    if (!compact) model::copy_from_global(mine, global[0].data(), params + mine.offset);
    if (!owned) {
      model::copy_from_global(mine, global[1].data(), m + mine.offset);
      model::copy_from_global(mine, global[2].data(), v + mine.offset);
      continue;
    }
    // Only the owned elements of this tensor, to where the owned ranges keep them (the
    // parameters too when they are held compact).
    std::vector<float> local[3];
    float* const to[3] = {compact ? params : nullptr, m, v};
    size_t state = 0;
    for (const optim::Range& r : *owned) {
      const size_t b = std::max(r.begin, mine.offset), e = std::min(r.end, mine.offset + mine.numel);
      if (b < e)
        for (int k = 0; k < 3; ++k) {
          if (!to[k]) continue;
          if (local[k].empty()) {
            local[k].resize(mine.numel);
            model::copy_from_global(mine, global[k].data(), local[k].data());
          }
          std::copy(local[k].begin() + (b - mine.offset), local[k].begin() + (e - mine.offset),
                    to[k] + state + (b - r.begin));
        }
      state += r.size();
    }
  }
  return c.state;
}

}  // namespace trn::checkpoint
