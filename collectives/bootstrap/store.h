// A key-value store through which ranks find each other (DESIGN.md layer 2). Implementations:
// the coordinator (gRPC; launcher/), a shared directory (FileStore), and MPI (MpiBootstrap).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/core/deadline.h"

namespace trn {

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value (overwrites).
  virtual void set(const std::string& key, const std::string& value) = 0;

  // Waits until key is set and returns its value. Throws a timeout Error naming the key (and,
  // where the store knows it, how many of the expected writers arrived) when deadline passes.
  virtual std::string get(const std::string& key, Deadline deadline) = 0;

  // Atomically adds delta to the integer at key (absent counts as 0) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Waits until every key is set; the default calls get() on each.
  virtual void wait(const std::vector<std::string>& keys, Deadline deadline) {
    for (const auto& k : keys) get(k, deadline);
  }
};

}  // namespace trn
