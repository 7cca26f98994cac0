// Runs one collective on a communicator with inputs that are a pure function of (rank, index)
// and checks every output element against a serial reference. Inputs are small integers (and,
// for prod, ±1 and 2), so every result is exact in every type and the check is bit-exact no
// matter the reduction order. Shared by the in-process unit tests and the multi-process tests.
#pragma once

#include <cstddef>
#include <string>

#include "collectives/communicator.h"

namespace trn::test {

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kAllToAll };
inline constexpr Coll kAllColls[] = {Coll::kAllReduce, Coll::kReduceScatter, Coll::kAllGather,
                                     Coll::kBroadcast, Coll::kReduce,        Coll::kAllToAll};
const char* to_string(Coll c);
Coll parse_coll(const std::string& name);
bool reduces(Coll c);

struct Case {
  Coll coll = Coll::kAllReduce;
  DataType type = DataType::kF32;
  ReduceOp op = ReduceOp::kSum;
  size_t count = 0;
  bool in_place = false;
  int root = 0;
};
std::string describe(const Case& c);

// Every rank of comm calls this with the same case. Returns "" when this rank's output is
// right, else a description of the first wrong element. Throws what the collective throws.
std::string run_and_verify(Communicator& comm, const Case& c, Deadline deadline);

// The input element (rank, index) as a double, and the reference result for output index i.
double input_value(const Case& c, int rank, size_t index);

}  // namespace trn::test
