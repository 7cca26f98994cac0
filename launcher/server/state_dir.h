// --state-dir: the coordinator's durable state, an append-only log of changes (DIR/state.log;
// the record format is documented at LogRecord in coordinator.proto). Each record holds one
// job's whole state or says the job was removed, so saving a change costs the size of the job
// it touches, never the size of the whole state. Every record carries an XXH64 checksum of its
// payload and a checksum of its length. When the log has grown past twice the live state (and
// a floor), it is compacted: the live records are written to a new log (temporary name, fsync,
// rename, directory fsync), so the log stays within a constant factor of the state.
//
// Loading: a missing log starts empty; a log whose last record was cut short (the shape a
// kill -9 in the middle of an append leaves) loses that record with a warning; anything else
// that is not a well-formed log (no header, a 0-byte file, a checksum mismatch, a directory in
// its place) is a usage error naming the file, so an operator decides and we never silently
// start empty over real state. A DIR/state.pb of an older trn (one whole snapshot, no
// checksum) is read once and rewritten as state.log.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

class StateDir {
 public:
  // Creates dir if needed; a usage error if it cannot be created or written, or if the log's
  // path is not a regular file.
  explicit StateDir(std::string dir);
  ~StateDir();
  StateDir(const StateDir&) = delete;
  StateDir& operator=(const StateDir&) = delete;

  // Reads the log (see above) and opens it for appending. Call once, before append().
  coordinator::v1::Snapshot load();
  // Appends one change (fdatasync'd before it returns) and compacts when the log is due.
  void append(const coordinator::v1::LogRecord& record);
  // Rewrites the log as its live records only.
  void compact();
  const std::string& path() const { return file_; }
  // Bytes in the log, and in its live records (for tests and trn-coordbench).
  uint64_t log_bytes() const { return log_bytes_; }
  uint64_t live_bytes() const { return live_bytes_; }

 private:
  void compact_locked();
  void open_for_append();

  std::string dir_, file_;
  std::mutex mu_;
  int fd_ = -1;
  uint64_t log_bytes_ = 0, live_bytes_ = 0;
  int64_t next_event_seq_ = 0;
  std::map<std::string, std::string> live_;  // job id -> its newest framed record
};

// Writes data to path atomically: temporary file in the same directory, fsync, rename, fsync
// of the directory. Throws trn::Error on failure.
void write_file_atomic(const std::string& path, const std::string& data);

// A usage error naming flag unless a file can be created at path: its folder exists and is
// writable, and path itself is not a folder.
void check_output_file(const std::string& path, const char* flag);

}  // namespace trn::control
