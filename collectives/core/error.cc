#include "collectives/core/error.h"

namespace trn {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUsage: return "usage error";
    case ErrorKind::kRemote: return "remote error";
    case ErrorKind::kTimeout: return "timeout";
    case ErrorKind::kAborted: return "aborted";
    case ErrorKind::kInternal: return "internal error";
  }
  return "error";
}

Error Error::with_context(const std::string& context) const {
  return Error(kind_, context + ": " + what());
}

int exit_code_for(ErrorKind kind) { return kind == ErrorKind::kUsage ? 2 : 1; }

}  // namespace trn
