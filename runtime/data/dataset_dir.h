// A dataset directory written by `trn-data tokenize` is a unit: whole, and from one run.
//
// tokenize builds it in a sibling directory (OUT.partial-<pid>) that holds a marker file,
// trn-dataset.partial, from its first byte to its last; it then writes trn-dataset.json, the
// manifest naming every file with its size and XXH64 hash, removes the marker and renames the
// directory to OUT. So OUT is either absent or complete, and a directory that still holds the
// marker is an unfinished run (its writer failed or was killed).
//
// Readers of shards (trn-train --data/--val-data, trn-data inspect) check the directory each
// shard sits in:
//   - it holds the marker: refused, whatever else it holds;
//   - it holds a manifest: every file it names must be there with its size (and, once opened,
//     its hash), and it must hold no other file; otherwise refused;
//   - neither: a directory trn-data did not write (a user's own Megatron shards, which carry no
//     manifest), read as it is.
// Every refusal is one usage error naming the directory, what is wrong and what to do.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trn::data {

inline constexpr const char* kDatasetManifest = "trn-dataset.json";
inline constexpr const char* kDatasetPartial = "trn-dataset.partial";

struct FileDigest {
  uint64_t bytes = 0;
  uint64_t xxh64 = 0;
};

// A manifest's files by name.
using DatasetManifest = std::map<std::string, FileDigest>;

// Hashes dir's files `names` (as they are now) and writes dir/trn-dataset.json naming them
// (temporary name, fsync, rename).
void write_dataset_manifest(const std::string& dir, const std::vector<std::string>& names);

// The check above for the directory dir, `flag` naming where it came from ("--data", "inspect").
// Returns the manifest, or nothing for a directory trn-data did not write. Hashes are not read
// here (see check_digest).
std::optional<DatasetManifest> check_dataset_dir(const std::string& dir, const std::string& flag);

// A usage error unless the bytes of `path` (named `name` in dir's manifest) have its digest.
void check_digest(const std::string& flag, const std::string& path, const FileDigest& want, const void* bytes,
                  uint64_t size);

// The directory a path sits in: "." for a bare name.
std::string parent_dir(const std::string& path);

}  // namespace trn::data
