// --state-dir: the coordinator's durable state, one snapshot file (state.pb) replaced
// atomically (written to a temporary name, fsynced, renamed, directory fsynced), so a kill -9
// at any moment leaves either the previous or the new snapshot, never a torn one.
#pragma once

#include <mutex>
#include <optional>
#include <string>

#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

class StateDir {
 public:
  // Creates dir if needed; a usage error if it cannot be created or written.
  explicit StateDir(std::string dir);
  // The last saved snapshot, or nullopt when there is none. A corrupt file is an error that
  // names it (the operator decides; we never silently start empty over real state).
  std::optional<coordinator::v1::Snapshot> load();
  void save(const coordinator::v1::Snapshot& snap);
  const std::string& path() const { return file_; }

 private:
  std::string dir_, file_;
  std::mutex mu_;
};

// Writes data to path atomically: temporary file in the same directory, fsync, rename, fsync
// of the directory. Throws trn::Error on failure.
void write_file_atomic(const std::string& path, const std::string& data);

}  // namespace trn::control
