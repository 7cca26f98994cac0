// Deadlines. Every blocking wait in trn takes one; nothing waits forever.
#pragma once

#include <chrono>

namespace trn {

using Clock = std::chrono::steady_clock;
using Duration = Clock::duration;

class Deadline {
 public:
  static Deadline after(Duration d) { return Deadline(Clock::now() + d); }
  static Deadline at(Clock::time_point t) { return Deadline(t); }
  // The process-wide default: now + TRN_TIMEOUT.
  static Deadline from_default_timeout();

  Clock::time_point when() const { return when_; }
  bool expired() const { return Clock::now() >= when_; }
  Duration remaining() const {
    auto r = when_ - Clock::now();
    return r < Duration::zero() ? Duration::zero() : r;
  }
  double remaining_seconds() const { return std::chrono::duration<double>(remaining()).count(); }
  Deadline earlier(Deadline other) const { return other.when_ < when_ ? other : *this; }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

// TRN_TIMEOUT as a duration (default 300 s).
Duration default_timeout();

}  // namespace trn
