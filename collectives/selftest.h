// Self-test of the collectives: runs one collective on a communicator with inputs that are a
// pure function of (rank, index) and checks every output element against a serial reference.
// Inputs are small integers (and, for prod, ±1 and 2), so every result is exact in every type and
// the check is bit-exact whatever the reduction order. Used by trn-collbench -c 1 and the tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace trn::selftest {

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kAllToAll, kAllToAllV };
inline constexpr Coll kAllColls[] = {Coll::kAllReduce, Coll::kReduceScatter, Coll::kAllGather, Coll::kBroadcast,
                                     Coll::kReduce,    Coll::kAllToAll,      Coll::kAllToAllV};
const char* to_string(Coll c);
Coll parse_coll(const std::string& name);
bool reduces(Coll c);

// Case::count of kAllToAllV is the count of all_to_all's blocks: each rank sends count * size()
// elements in all, split by uneven_counts.
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

// all_to_all_v's counts: element [i * n + j] is what rank i sends rank j.
using CountMatrix = std::vector<size_t>;
// trn-collbench's uneven pattern (and Case's): each rank sends total elements (total / n of them
// to itself, as all_to_all keeps, so the same bytes cross as in all_to_all) and the rest to the
// others by their distance d = (j - i) mod n in weights 2, 0, 1, 2, 0, 1, ... (d = 1, 2, 3, ...;
// the last peer with a weight takes the rounding). So with 3 ranks or more some pairs exchange
// nothing and others twice the mean, every rank receives what it sends, and with 2 ranks it is
// all_to_all's split.
CountMatrix uneven_counts(size_t total, int n);
// Counts in [0, max], about a quarter of them zero (the diagonal too), from seed: the same on
// every rank that passes the same seed.
CountMatrix random_counts(uint64_t seed, size_t max, int n);

// An all_to_all_v over comm with these counts. gaps: the regions of each side are laid out in
// reverse rank order with a few elements between them (explicit displacements; else packed
// in rank order, displacements omitted). in_place: in and out are one buffer, the receive
// regions at its start and the send regions overlapping them.
struct VCase {
  DataType type = DataType::kF32;
  CountMatrix counts;
  bool gaps = false;
  bool in_place = false;
};
std::string describe(const VCase& c);
// Checks every received element and that the gaps stay untouched.
Outcome run_all_to_all_v(Communicator& comm, const VCase& c, Deadline deadline);

// The input element (rank, index) as a double, and the reference result for output index i.
double input_value(const Case& c, int rank, size_t index);

}  // namespace trn::selftest
