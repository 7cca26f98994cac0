// What trn's fuzz targets share (tests/fuzz/*.cc; cmake/TrnFuzz.cmake builds them).
//
// The contract every target checks: a parser given any bytes either accepts them or throws one
// usage error (trn::ErrorKind::kUsage) whose message is one line. Anything else, an internal
// error, another exception, a crash or a sanitizer report, is a bug, and the target aborts so
// that libFuzzer keeps the input.
//
// Parsers of what a peer sends (the fabric's rings and messages, the agent's datagrams: the
// wire targets) refuse bad bytes the way trn refuses a misbehaving peer: with a remote error
// (ErrorKind::kRemote), which the caller turns into the loss of that peer, naming it. Wire
// targets check with accepts_wire, which takes a usage or a remote error in one line.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "collectives/core/error.h"

namespace trn::fuzz {

// Logging off from the start (a parser or the registry may log about each input): before main(),
// so before anything reads TRN_LOG_LEVEL.
inline const bool kQuiet = ::setenv("TRN_LOG_LEVEL", "off", 1) == 0;

// Stops the target: libFuzzer reports the input that got here.
[[noreturn]] inline void fail(const std::string& why) {
  std::fprintf(stderr, "fuzz target failed: %s\n", why.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void require(bool ok, const std::string& why) {
  if (!ok) fail(why);
}
// The same for a literal: no string is made unless it fails (targets check in their inner loops).
inline void require(bool ok, const char* why) {
  if (!ok) fail(why);
}

// Once per process: a private scratch folder in memory (/dev/shm, else TMPDIR) for parsers that read files, removed at exit.
inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path base = "/dev/shm";
    if (!std::filesystem::is_directory(base)) base = std::filesystem::temp_directory_path();
    std::string tmpl = (base / "trn-fuzz.XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) fail("cannot create a scratch folder under " + base.string());
    std::atexit([] { std::error_code ec; std::filesystem::remove_all(scratch(), ec); });
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

// Writes bytes to path (replacing it).
inline void put(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) fail("cannot write " + path.string());
}

// An input that stands for several files: parts separated by kSeparator. Seeds are written the
// same way, so mutations reach every part.
inline constexpr std::string_view kSeparator = "\n--trn-fuzz-part--\n";
inline std::vector<std::string_view> split(const uint8_t* data, size_t size, size_t max_parts) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = in.find(kSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(in.substr(0, at));
    in.remove_prefix(at + kSeparator.size());
  }
  parts.push_back(in);
  return parts;
}

// Runs f. A usage error in one line is an accepted refusal (returns false); any other trn::Error
// fails the target, and any other exception escapes and ends the process (std::terminate).
template <typename F>
bool accepts(F&& f, bool remote_too = false) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    const std::string what = e.what();
    if (e.kind() != ErrorKind::kUsage && !(remote_too && e.kind() == ErrorKind::kRemote))
      fail(std::string(to_string(e.kind())) + " error: " + what);
    if (what.empty() || what.find('\n') != std::string::npos) fail("a refusal that is not one line: " + what);
    return false;
  }
}

// accepts for the wire targets: a remote error in one line is an accepted refusal too.
template <typename F>
bool accepts_wire(F&& f) {
  return accepts(std::forward<F>(f), true);
}

}  // namespace trn::fuzz
