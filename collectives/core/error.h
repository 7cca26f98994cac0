// trn's error type. Every failure that reaches a user is one of these, and its kind says whose
// fault it is: the user's (a bad flag, a layout that does not divide the world), a peer's (it
// died, stopped answering, or sent something we did not expect), or ours (a bug).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <string_view>

namespace trn {

enum class ErrorKind {
  kUsage,     // the caller's mistake; the message says how to fix it
  kRemote,    // a peer failed or misbehaved; the message names the peer
  kTimeout,   // a deadline passed; the message names what was awaited
  kAborted,   // the operation was cancelled by abort()
  kInternal,  // a bug in trn
};

const char* to_string(ErrorKind kind);

// Text from input (a name, a pattern, a token) made fit for a one-line message: control bytes
// become \n, \r, \t or \xNN, so no input can break an error into several lines. Backslashes and
// bytes 0x80 and above pass unchanged (a regular expression and UTF-8 stay readable).
std::string one_line(std::string_view text);

class Error : public std::runtime_error {
 public:
  // The message is kept in one line (one_line): an error names input it refuses (a path, a
  // pattern, a token), and no input can split what a user or a log reader sees into lines.
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(one_line(message)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

  // A copy whose message is prefixed with "context: ", for breadcrumbs through the layers.
  Error with_context(const std::string& context) const;

 private:
  ErrorKind kind_;
};

template <typename... Args>
Error usage_error(fmt::format_string<Args...> f, Args&&... args) {
  return Error(ErrorKind::kUsage, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Error remote_error(fmt::format_string<Args...> f, Args&&... args) {
  return Error(ErrorKind::kRemote, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Error timeout_error(fmt::format_string<Args...> f, Args&&... args) {
  return Error(ErrorKind::kTimeout, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Error aborted_error(fmt::format_string<Args...> f, Args&&... args) {
  return Error(ErrorKind::kAborted, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
Error internal_error(fmt::format_string<Args...> f, Args&&... args) {
  return Error(ErrorKind::kInternal, fmt::format(f, std::forward<Args>(args)...));
}

// Exit status for a process ending with an error of this kind: 2 for usage, 1 otherwise.
int exit_code_for(ErrorKind kind);

}  // namespace trn

// Checks an internal invariant; a failure is a trn bug, reported with file and line.
#define TRN_CHECK(cond)                                                                    \
  do {                                                                                     \
    if (!(cond)) throw ::trn::internal_error("{}:{}: check failed: {}", __FILE__, __LINE__, #cond); \
  } while (0)
