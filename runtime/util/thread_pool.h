// A fixed set of compute threads that run one job at a time: run(fn) calls fn(k) for every
// k in [0, size()), k = 0 on the calling thread, and returns when all are done. Workers sleep on
// a condition variable between jobs (they never spin), so they leave the cores to OpenBLAS or
// other processes. An exception thrown by any fn(k) is rethrown by run().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trn {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  void run(const std::function<void(int)>& fn);

 private:
  void loop(int k);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace trn
