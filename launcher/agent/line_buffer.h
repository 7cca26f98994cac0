// Splits a byte stream into whole lines, so that a worker's output is forwarded one complete line
// at a time and lines of different workers never interleave mid-line. A line longer than
// max_line is passed on in pieces of max_line bytes (each ending in '\n').
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace trn::launch {

class LineBuffer {
 public:
  using Emit = std::function<void(std::string_view line)>;  // line ends with '\n'

  explicit LineBuffer(size_t max_line = 64 * 1024) : max_line_(max_line) {}
  // Adds bytes; emits every line they complete.
  void feed(std::string_view bytes, const Emit& emit);
  // Emits what is left (a last line without '\n' gets one).
  void flush(const Emit& emit);
  size_t pending() const { return partial_.size(); }

 private:
  size_t max_line_;
  std::string partial_;
};

}  // namespace trn::launch
