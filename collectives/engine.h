// The thread that runs a transport's operations (internal to the communicator). One per world
// transport, shared by every communicator split from it. It sleeps on a condition variable
// while the queue is empty and runs operations strictly in submission order.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"
#include "collectives/p2p.h"

namespace trn {

struct WorkState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::optional<Error> error;
  std::string what;
};

class Engine {
 public:
  explicit Engine(std::shared_ptr<PointToPoint> transport);
  ~Engine();

  PointToPoint& transport() { return *transport_; }
  algo::Scratch& scratch() { return scratch_; }
  // Runs fn on the engine thread after everything submitted before; state completes with fn's
  // outcome. After a failure or abort every later fn is skipped and its state fails.
  void submit(std::shared_ptr<WorkState> state, std::function<void()> fn);
  void abort(const std::string& reason);
  bool failed() const;

  // Smallest communicator id not yet used in this process (engine thread only).
  uint32_t next_comm_id = 1;

 private:
  struct Task {
    std::shared_ptr<WorkState> state;
    std::function<void()> fn;
  };
  void loop();
  void fail_locked(const Error& e);
  static void finish(WorkState& s, std::optional<Error> error);

  std::shared_ptr<PointToPoint> transport_;
  algo::Scratch scratch_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool running_task_ = false;
  bool stop_ = false;
  std::optional<Error> failure_;
  std::thread thread_;
};

}  // namespace trn
