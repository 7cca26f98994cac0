// n communicators over one in-process transport, and a helper that runs a function on every
// rank in its own thread. Rank threads never touch Catch2 (it is not thread-safe): they return
// strings (empty means fine) and the test thread asserts on them.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/local_p2p.h"

namespace trn::test {

class LocalWorld {
 public:
  // hosts: the host each rank's transport reports (host_of); empty: one host.
  explicit LocalWorld(int n, CommOptions opts = {}, std::vector<int> hosts = {}) {
    // Constructing is cheap and does not wait for the peers (the agreement on the cost model
    // runs as each communicator's first operation).
    for (auto& p : make_local_group(n, hosts)) comms_.push_back(std::make_shared<Communicator>(p, opts));
  }
  int size() const { return static_cast<int>(comms_.size()); }
  Communicator& comm(int r) { return *comms_[r]; }

  // Runs fn(comm, rank) on every rank concurrently; returns one string per rank: fn's result,
  // or "error: ..." if it threw.
  std::vector<std::string> run(const std::function<std::string(Communicator&, int)>& fn) {
    std::vector<std::string> out(comms_.size());
    std::vector<std::thread> threads;
    for (int r = 0; r < size(); ++r)
      threads.emplace_back([&, r] {
        try {
          out[r] = fn(*comms_[r], r);
        } catch (const std::exception& e) {
          out[r] = std::string("error: ") + e.what();
        }
      });
    for (auto& t : threads) t.join();
    return out;
  }

 private:
  std::vector<std::shared_ptr<Communicator>> comms_;
};

inline std::string first_failure(const std::vector<std::string>& results) {
  for (size_t r = 0; r < results.size(); ++r)
    if (!results[r].empty()) return "rank " + std::to_string(r) + ": " + results[r];
  return "";
}

}  // namespace trn::test
