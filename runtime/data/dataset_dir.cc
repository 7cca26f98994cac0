#include "runtime/data/dataset_dir.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "collectives/core/error.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"

namespace trn::data {
namespace {

constexpr const char* kFormat = "trn-dataset";
constexpr int kVersion = 1;
using nlohmann::json;

// The names in dir, without "." and "..", sorted.
std::vector<std::string> entries(const std::string& dir, const std::string& flag) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw usage_error("{}: cannot read the directory {}: {}", flag, dir, std::strerror(errno));
  std::vector<std::string> out;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// A file name a manifest may hold: one entry of its own directory, never a path.
bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\0') == std::string::npos;
}

DatasetManifest parse_manifest(const std::string& path) {
  const json j = json::parse(io::read_input_file("dataset manifest", path), nullptr, false);
  auto bad = [&](const std::string& what) {
    return usage_error("damaged dataset manifest {}: {}; tokenize the dataset again", path, what);
  };
  if (j.is_discarded() || !j.is_object()) throw bad("not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat)
    throw bad(fmt::format("\"format\" is not \"{}\"", kFormat));
  if (!j.contains("version") || j["version"] != kVersion)
    throw bad(fmt::format("\"version\" is not {} (written by another trn?)", kVersion));
  if (!j.contains("files") || !j["files"].is_array()) throw bad("\"files\" is not an array");
  DatasetManifest m;
  for (const json& f : j["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string() || !f.contains("bytes") ||
        !f["bytes"].is_number_unsigned() || !f.contains("xxh64") || !f["xxh64"].is_number_unsigned())
      throw bad("an entry of \"files\" is not {\"name\": string, \"bytes\": size, \"xxh64\": hash}");
    const std::string name = f["name"].get<std::string>();
    if (!plain_name(name) || name == kDatasetManifest || name == kDatasetPartial)
      throw bad(fmt::format("\"files\" names \"{}\", not a file of the dataset", name));
    if (!m.emplace(name, FileDigest{f["bytes"].get<uint64_t>(), f["xxh64"].get<uint64_t>()}).second)
      throw bad(fmt::format("\"files\" names {} twice", name));
  }
  return m;
}

// The size and hash of a file, read in pieces.
FileDigest digest_of(const std::string& path) {
  const io::InputFile in("dataset file", path);
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  std::vector<char> buf(1 << 20);
  uint64_t at = 0;
  for (ssize_t n; (n = ::pread(in.fd(), buf.data(), buf.size(), off_t(at))) != 0; at += uint64_t(n)) {
    if (n < 0 && errno == EINTR) {
      n = 0;
      continue;
    }
    if (n < 0) {
      XXH64_freeState(st);
      throw usage_error("cannot read dataset file {}: {}", path, std::strerror(errno));
    }
    XXH64_update(st, buf.data(), size_t(n));
  }
  const FileDigest d{at, XXH64_digest(st)};
  XXH64_freeState(st);
  return d;
}

}  // namespace

std::string parent_dir(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void write_dataset_manifest(const std::string& dir, const std::vector<std::string>& names) {
  json files = json::array();
  for (const auto& n : names) {
    const FileDigest d = digest_of(dir + "/" + n);
    files.push_back({{"name", n}, {"bytes", d.bytes}, {"xxh64", d.xxh64}});
  }
  const json j = {{"format", kFormat}, {"version", kVersion}, {"files", files}};
  io::write_file_atomic(dir + "/" + kDatasetManifest, j.dump(1) + "\n");
}

std::optional<DatasetManifest> check_dataset_dir(const std::string& dir, const std::string& flag) {
  const std::vector<std::string> names = entries(dir, flag);
  auto has = [&](const char* n) { return std::binary_search(names.begin(), names.end(), std::string(n)); };
  if (has(kDatasetPartial))
    throw usage_error(
        "{}: {} is an unfinished trn-data tokenize output (it still holds {}: its writer failed or "
        "was stopped); run trn-data tokenize again into a new directory",
        flag, dir, kDatasetPartial);
  if (!has(kDatasetManifest)) return std::nullopt;
  const std::string manifest_path = dir + "/" + kDatasetManifest;
  DatasetManifest m = parse_manifest(manifest_path);
  for (const auto& n : names)
    if (n != kDatasetManifest && !m.count(n))
      throw usage_error(
          "{}: {} holds {}, which its manifest {} does not name: the directory mixes another run's or "
          "another tool's files with this dataset; remove {} or tokenize again into a new directory",
          flag, dir, n, kDatasetManifest, n);
  for (const auto& [n, digest] : m) {
    const std::string path = dir + "/" + n;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      throw usage_error(
          "{}: {} is incomplete: {}, named by its manifest, is missing; tokenize the dataset again", flag,
          dir, n);
    if (uint64_t(st.st_size) != digest.bytes)
      throw usage_error(
          "{}: {} is damaged: {} has {} bytes, its manifest says {} (truncated or replaced); tokenize "
          "the dataset again",
          flag, dir, n, uint64_t(st.st_size), digest.bytes);
  }
  return m;
}

void check_digest(const std::string& flag, const std::string& path, const FileDigest& want, const void* bytes,
                  uint64_t size) {
  if (size != want.bytes || XXH64(bytes, size, 0) != want.xxh64)
    throw usage_error(
        "{}: {} is damaged: its bytes do not match the hash in its dataset manifest {}; tokenize the "
        "dataset again",
        flag, path, kDatasetManifest);
}

}  // namespace trn::data
