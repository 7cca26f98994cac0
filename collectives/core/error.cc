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

std::string one_line(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) out += fmt::format("\\x{:02x}", u);
    else out += c;
  }
  return out;
}

int exit_code_for(ErrorKind kind) { return kind == ErrorKind::kUsage ? 2 : 1; }

}  // namespace trn
