// The outcome of a coordinator operation, independent of gRPC (the service maps it to a gRPC
// status). Messages are whole sentences a user can act on.
#pragma once

#include <string>
#include <utility>

namespace trn::control {

enum class Code {
  kOk,
  kInvalidArgument,    // malformed or out-of-range request; nothing changed
  kNotFound,           // no such job
  kDeadlineExceeded,   // a wait ran out of time
  kAborted,            // the job's generation moved on; stop and re-join
  kFailedPrecondition, // the job is in a state that does not allow this (e.g. completed)
  kResourceExhausted,  // a per-job limit was reached
  kUnavailable,        // the coordinator is shutting down; retry against its successor
};

struct Status {
  Code code = Code::kOk;
  std::string message;
  bool ok() const { return code == Code::kOk; }
  static Status Ok() { return {}; }
  static Status Make(Code c, std::string m) { return {c, std::move(m)}; }
};

const char* to_string(Code code);

}  // namespace trn::control
