// A Store in a directory every rank can see (a local temp dir, or NFS across hosts): one file
// per key. Needs no server, so tests and single-host jobs bootstrap with TRN_STORE_DIR alone.
//
//  - set() writes a temporary file, fsyncs it, renames it over the key's file and fsyncs the
//    directory: a reader sees the old value or the new one, never a torn one.
//  - get() polls (1 ms growing to 20 ms) until the file exists or the deadline passes.
//  - add() holds an exclusive flock(2) on the key's lock file while it reads, adds and rewrites,
//    so concurrent adders from many processes never lose an update.
#pragma once

#include <memory>
#include <string>

#include "collectives/bootstrap/store.h"

namespace trn {

class FileStore : public Store {
 public:
  // Creates dir (and parents) when missing.
  explicit FileStore(std::string dir);

  // The store in TRN_STORE_DIR; a usage error when it is unset.
  static std::unique_ptr<FileStore> from_environment();

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta) override;

  // The value if the key is set now, without waiting.
  bool try_get(const std::string& key, std::string* value);

  const std::string& dir() const { return dir_; }

 private:
  std::string path(const std::string& key) const;
  std::string dir_;
};

}  // namespace trn
