// Self-test of the collectives: runs one collective on a communicator with inputs that are a
// pure function of (rank, index) and checks every output element against a serial reference.
// Inputs are small integers (and, for prod, ±1 and 2), so every result is exact in every type and
// the check is bit-exact whatever the reduction order. Used by trn-collbench -c 1 and the tests.
#pragma once

#include <cstddef>
#include <string>

#include "collectives/communicator.h"

namespace trn::selftest {

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

struct Outcome {
  size_t wrong = 0;   // output elements of this rank that differ from the reference
  std::string first;  // description of the first one
};

// Every rank of comm calls this with the same case. Throws what the collective throws.
Outcome run_case(Communicator& comm, const Case& c, Deadline deadline);
// run_case, as "" when right, else the first wrong element.
std::string run_and_verify(Communicator& comm, const Case& c, Deadline deadline);

// The input element (rank, index) as a double, and the reference result for output index i.
double input_value(const Case& c, int rank, size_t index);

}  // namespace trn::selftest
