// Choosing an all-reduce algorithm: an alpha-beta-gamma cost model, as a pure function.
//
//   time = messages on the critical path * alpha + bytes on the wire * beta
//          + bytes reduced on the critical path * gamma
//
// alpha is the latency of one message, beta the time per byte moved, gamma the time per byte
// reduced. Ring pipelines its chunks, so part of its reduction time hides behind transfers
// (ring_overlap). Parameters come from the transport (params_for_transport) and can be set by
// hand in tests. TRN_ALGO=ring|tree|rhd overrides the choice.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace trn {

enum class Algo { kAuto, kRing, kTree, kRhd };

const char* to_string(Algo a);
// "ring", "tree", "rhd" or "auto"; anything else is a usage error listing the choices.
Algo parse_algo(std::string_view name);

struct CostParams {
  double alpha_us = 10;          // per message
  double beta_us_per_kib = 0.2;  // per KiB moved (1 / bandwidth)
  double gamma_us_per_kib = 0.1; // per KiB reduced
  double ring_overlap = 0;       // fraction of ring's reduction hidden behind its transfers
  double chunk_kib = 512;        // pipeline chunk (tree fill latency)
  // Ring segments up to this size travel as one message (0, every transport's default: always
  // chunk_kib chunks). Only worth it where a message costs so much that pipelining a segment
  // that fits in cache does not repay it, as over libfabric's shm before trn's rings
  // (bench/results/2026-11-29-ring-chunks.md).
  double ring_unchunked_kib = 0;
};

// The ring's chunk for segments of segment_bytes under p (chunk_bytes: the communicator's
// chunk, normally p.chunk_kib).
size_t ring_chunk_bytes(const CostParams& p, size_t chunk_bytes, size_t segment_bytes);

// Parameters for a transport, from its describe() string (shm, tcp, efa, local).
CostParams params_for_transport(std::string_view describe);

// The parameters as a flat array (for agreeing on them across ranks) and back.
inline constexpr int kCostParamCount = 6;
void to_array(const CostParams& p, double out[kCostParamCount]);
CostParams from_array(const double in[kCostParamCount]);

// Modelled time in microseconds of an all-reduce of bytes over n ranks.
double allreduce_cost_us(Algo a, int n, size_t bytes, const CostParams& p);
// The algorithm with the least modelled time (ties: ring, then rhd, then tree).
Algo choose_allreduce(int n, size_t bytes, const CostParams& p);

// Sizes 8 B .. 1 GiB (powers of two) at which the choice changes, with the new choice; the
// first entry is the choice at 8 B.
struct Crossover {
  size_t bytes;
  Algo algo;
};
std::vector<Crossover> crossovers(int n, const CostParams& p);
std::string describe_crossovers(int n, const CostParams& p);

}  // namespace trn
