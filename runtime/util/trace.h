// A timeline of what a rank does (--trace): spans recorded as Chrome trace events ("ph": "X"),
// which Perfetto and chrome://tracing open. One track (pid) per rank; times are wall-clock
// microseconds, so the ranks of one host line up when merged.
//
//   trace::Span span("forward", "compute", {{"mb", 3}});   // recorded when it ends
//
// Recording is off (a Span costs a branch) until trace::enable().
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trn::trace {

void enable(int rank);
bool enabled();
// The events recorded so far, as a comma-separated list of JSON objects (no brackets).
std::string events_json();

class Span {
 public:
  Span(const char* name, const char* category, std::vector<std::pair<const char*, int64_t>> args = {});
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_;
  const char* category_;
  std::vector<std::pair<const char*, int64_t>> args_;
  int64_t start_us_ = -1;
};

}  // namespace trn::trace
