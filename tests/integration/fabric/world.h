// Helpers for fabric tests that run a world of real processes bootstrapped through a FileStore.
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "collectives/bootstrap/file_store.h"
#include "collectives/core/error.h"
#include "collectives/core/main.h"
#include "collectives/fabric/fabric.h"
#include "tests/support/process.h"

namespace trn::test {

// Children get: rank, size, store dir, then extra args.
struct WorldArgs {
  int rank = 0, size = 0;
  std::string dir;
  std::vector<std::string> extra;
};

inline WorldArgs parse_world(const std::vector<std::string>& args) {
  WorldArgs w;
  w.rank = std::stoi(args.at(0));
  w.size = std::stoi(args.at(1));
  w.dir = args.at(2);
  w.extra.assign(args.begin() + 3, args.end());
  return w;
}

inline std::vector<ProcResult> run_world(const std::string& name, int n, std::map<std::string, std::string> env,
                                         std::vector<std::string> extra = {},
                                         std::chrono::seconds timeout = std::chrono::seconds(60)) {
  TempDir dir;
  std::vector<ProcSpec> specs;
  env.emplace("TRN_LOG_LEVEL", "warn");
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> args = {std::to_string(r), std::to_string(n), dir.path()};
    args.insert(args.end(), extra.begin(), extra.end());
    specs.push_back(child(name, args, env));
  }
  return run_all(specs, timeout);
}

inline void require_all_ok(const std::vector<ProcResult>& rs) {
  for (size_t i = 0; i < rs.size(); ++i) {
    INFO("rank " << i << ": " << rs[i].describe());
    CHECK(rs[i].ok());
  }
}

// The byte at offset i of the message with this seed.
inline uint8_t pattern(uint64_t seed, size_t i) {
  return static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
}

inline std::vector<uint8_t> make_message(uint64_t seed, size_t len) {
  std::vector<uint8_t> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = pattern(seed, i);
  return v;
}

// First offset where buf differs from the pattern, or -1.
inline int64_t first_mismatch(uint64_t seed, const uint8_t* buf, size_t len) {
  for (size_t i = 0; i < len; ++i)
    if (buf[i] != pattern(seed, i)) return static_cast<int64_t>(i);
  return -1;
}

// Provider environments every transfer test runs over: tcp alone; shm with trn's rings (messages
// up to 256 KiB inside them, longer ones pulled from the sender's memory); tcp plus shm with
// rings that only announce messages, every one pulled; the same with libfabric's shm carrying
// them instead of pulls; shm alone.
inline std::vector<std::map<std::string, std::string>> provider_envs() {
  return {
      {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "0"}},
      {{"TRN_FABRIC_PROVIDER", "shm"}},
      {{"TRN_FABRIC_PROVIDER", "tcp"}, {"TRN_FABRIC_SHM", "1"}, {"TRN_FABRIC_RING_EAGER", "0"}},
      {{"TRN_FABRIC_PROVIDER", "shm"}, {"TRN_FABRIC_RING_EAGER", "0"}, {"TRN_FABRIC_PULL", "0"}},
      {{"TRN_FABRIC_PROVIDER", "shm"}, {"TRN_FABRIC_RING", "0"}},
  };
}

inline std::string env_name(const std::map<std::string, std::string>& env) {
  std::string s;
  for (const auto& [k, v] : env) s += k + "=" + v + " ";
  return s;
}

}  // namespace trn::test
