// Forwards the stdout and stderr of every worker, one whole line at a time, from one background
// thread: to trnrun's stdout/stderr with a "[rank R] " prefix, and/or to a per-rank log file.
// A log file is written as PATH.partial and, once the worker's output has ended, fsynced and
// renamed to PATH, so a complete log never looks half-written.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/core/deadline.h"
#include "launcher/agent/line_buffer.h"

namespace trn::launch {

struct OutputSink {
  std::string prefix;    // put before every console line, e.g. "[rank 3] "
  bool console = true;   // forward to trnrun's stdout / stderr
  std::string log_path;  // empty: no log file
};

class OutputPump {
 public:
  // console_out / console_err: where console lines go (not owned).
  explicit OutputPump(int console_out = 1, int console_err = 2);
  ~OutputPump();
  OutputPump(const OutputPump&) = delete;
  OutputPump& operator=(const OutputPump&) = delete;

  // Takes ownership of the read ends of a worker's stdout and stderr pipes. A usage error when
  // the log file cannot be created.
  void add(int out_fd, int err_fd, OutputSink sink);
  // Waits until every stream has ended (all writers closed) or the deadline passes; then closes
  // whatever is left, flushing partial lines and finishing log files. True when all had ended.
  bool drain(Deadline deadline);

 private:
  struct Stream;
  void run();
  void read_ready(Stream& s, int which);
  void finish(Stream& s);
  void write_line(Stream& s, int which, std::string_view line);
  void wake();

  int console_[2];
  int wake_pipe_[2] = {-1, -1};
  std::mutex mu_;
  std::condition_variable changed_;
  std::vector<std::unique_ptr<Stream>> streams_;
  uint64_t epoch_ = 0;  // bumped when drain() drops streams
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace trn::launch
