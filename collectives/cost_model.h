// Choosing an all-reduce algorithm: an alpha-beta-gamma cost model, as a pure function.
//
//   time = messages on the critical path * alpha + bytes on the wire * beta
//          + bytes reduced on the critical path * gamma
//
// alpha is the latency of one message, beta the time per byte moved, gamma the time per byte
// reduced. Ring pipelines its chunks, so part of its reduction time hides behind transfers
// (ring_overlap). Parameters come from the transport (model_for_transport) and can be set by
// hand in tests. TRN_ALGO=ring|tree|rhd|hier overrides the choice.
//
// There are two sets of parameters (CostModel): between ranks of one host (intra: shm, or the
// main provider when shm is off) and between hosts (inter: the main provider). A communicator
// knows how its ranks sit on hosts (HostLayout, from the fabric's bootstrap records, identical
// on every rank). Flat algorithms (ring, tree, rhd) are modelled over the slowest link they
// cross: intra on one host, inter across hosts. The hierarchical all-reduce (hier) is a ring
// reduce-scatter among each host's ranks (intra), an all-reduce of each piece among the ranks
// of all hosts that hold it (inter; ring, tree or rhd, whichever models fastest), and a ring
// all-gather within each host (intra). It is a candidate only with several hosts, several ranks
// on each and the same number on every host.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace trn {

enum class Algo { kAuto, kRing, kTree, kRhd, kHier };

const char* to_string(Algo a);
// "ring", "tree", "rhd", "hier" or "auto"; anything else is a usage error listing the choices.
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
  // How much streams from the ranks of one host to other hosts share the host's link: 1, they
  // split its bandwidth (a NIC-bound link: efa); 0, each runs at a full stream's speed (where one
  // connection is bound by its own copies and protocol work rather than the wire: tcp). hier's
  // middle phase runs L such streams per host (bench/results/2026-12-01-hierarchical-allreduce.md).
  double link_shared = 1;
  // The all-to-alls' chunk (all_to_all_v.cc; 0: chunk_kib). Over trn's shm rings 256 KiB chunks
  // travel inside the rings, where a longer message is pulled whole. Over tcp (rxm) every chunk
  // up to rxm's eager limit (512 KiB) is copied into and out of rxm's buffers on top of the
  // socket's copies, and a longer one is read straight into the receive buffer after one round
  // trip, so its all-to-all messages go in 4 MiB chunks: one message up to 4 MiB
  // (bench/results/2026-12-07-all-to-all-quiet.md).
  double a2a_chunk_kib = 0;
};

// The all-to-alls' chunk under p (a2a_chunk_kib, or chunk_kib when that is 0), in bytes.
size_t a2a_chunk_bytes(const CostParams& p);

// The ring's chunk for segments of segment_bytes under p (chunk_bytes: the communicator's
// chunk, normally p.chunk_kib).
size_t ring_chunk_bytes(const CostParams& p, size_t chunk_bytes, size_t segment_bytes);

// Parameters for one kind of link (shm, tcp, efa, local), from a describe() string.
CostParams params_for_transport(std::string_view describe);

// The parameters of both kinds of link.
struct CostModel {
  CostParams intra;  // between ranks of one host
  CostParams inter;  // between hosts
};
// From a transport's describe() ("rank 0/4 tcp;ofi_rxm on eth0 + shm to 1 rank(s) on this
// host"): inter from its main provider (the text before " + "), intra shm when it reaches
// same-host ranks through shm, else the main provider's.
CostModel model_for_transport(std::string_view describe);
// Both sets the same (a communicator whose links are all alike, or a test's parameters).
inline CostModel uniform_model(const CostParams& p) { return CostModel{p, p}; }

// The parameters as a flat array (for agreeing on them across ranks) and back.
inline constexpr int kCostParamCount = 8;
void to_array(const CostParams& p, double out[kCostParamCount]);
CostParams from_array(const double in[kCostParamCount]);

// How a communicator's ranks sit on hosts.
struct HostLayout {
  int ranks = 1;
  int hosts = 1;
  int per_host = 1;  // ranks on each host when every host has the same number; 0 when uneven
  std::vector<int> counts;  // ranks on each host, hosts in order of their lowest rank
  bool uniform() const { return per_host > 0; }
  // Whether hier can run: the same number of ranks on every host.
  bool hier_possible() const { return uniform(); }
  // Whether hier differs from a flat ring: several hosts with several ranks each.
  bool hierarchical() const { return hosts > 1 && per_host > 1; }
  // "2 hosts x 2 ranks", "1 host x 4 ranks", "4 ranks on 2 hosts (3 + 1)".
  std::string describe() const;
};
// host_of[i]: any value naming the host of member i (equal for members of one host).
HostLayout host_layout(const std::vector<int>& host_of);
// The parameters the flat algorithms run under on layout: intra on one host, inter across.
const CostParams& flat_params(const HostLayout& layout, const CostModel& m);

// Modelled time in microseconds of a flat all-reduce (ring, tree or rhd; auto: the fastest) of
// bytes over n ranks whose links all have parameters p.
double allreduce_cost_us(Algo a, int n, size_t bytes, const CostParams& p);
// The flat algorithm with the least modelled time (ties: ring, then rhd, then tree).
Algo choose_allreduce(int n, size_t bytes, const CostParams& p);

// The same on a layout of hosts. hier's time is its intra-host ring plus its inter-host phase,
// in which every rank of a host sends at once: with link_shared 1 they split the host's link,
// each moving its piece at 1/per_host of its bandwidth. hier on a layout that cannot run it
// (uneven) costs infinity; auto considers hier only where layout.hierarchical().
double allreduce_cost_us(Algo a, const HostLayout& layout, size_t bytes, const CostModel& m);
// The algorithm with the least modelled time (ties: ring, then rhd, then tree, then hier).
Algo choose_allreduce(const HostLayout& layout, size_t bytes, const CostModel& m);
// The algorithm hier's inter-host phase runs for an all-reduce of bytes (every piece: the
// largest piece decides, so all the ranks of a piece agree).
Algo hier_cross_algo(const HostLayout& layout, size_t bytes, const CostModel& m);
// The largest vector rhd all-reduces over n ranks by recursive doubling of whole vectors (log2 p
// exchanges of the whole) rather than recursive halving and doubling (2 log2 p exchanges that move
// (p-1)/p of it twice): up to where the doubling's extra bytes and reduction cost more than the
// halving's extra messages under p. A link of high latency doubles further: 2 ranks over tcp up to
// about 670 KiB, over shm about 170 KiB. Every rank computes it from the same parameters (agreed
// when measured; CommOptions::params must be stated alike on every rank), so all take the same
// branch. hier_cross_doubling_max_bytes: the same for hier's phase across hosts.
size_t rhd_doubling_max_bytes(int n, const CostParams& p);
size_t hier_cross_doubling_max_bytes(const HostLayout& layout, const CostModel& m);

// The all-to-alls' algorithms (Communicator::all_to_all_v, and all_to_all with equal blocks). Both send the same
// messages (exactly one per ordered pair of ranks, empty ones too) under the same tags, and differ
// only in how many are in flight, so ranks may choose differently within one operation:
//   direct    every receive and every send posted at once, then all awaited: one message latency
//             for the whole exchange, the fastest while latency dominates;
//   pairwise  n - 1 steps; in step s a rank exchanges with ranks r + s and r - s only and waits for
//             both before the next, so each link carries one stream at a time and a receiver
//             never has n - 1 large messages arriving at once (memory and link contention).
// kAuto (TRN_A2A_ALGO, then size): direct while the larger of the bytes a rank sends and
// receives is at most kA2avDirectMaxBytes, pairwise above.
enum class A2aAlgo { kAuto, kPairwise, kDirect };
const char* to_string(A2aAlgo a);
// "pairwise", "direct" or "auto"; anything else is a usage error listing the choices.
A2aAlgo parse_a2a_algo(std::string_view name);
inline constexpr size_t kA2avDirectMaxBytes = 256 * 1024;
// The algorithm for a rank that sends send_bytes and receives recv_bytes in all (forced: as is).
inline A2aAlgo choose_all_to_all_v(A2aAlgo forced, size_t send_bytes, size_t recv_bytes) {
  if (forced != A2aAlgo::kAuto) return forced;
  return (send_bytes > recv_bytes ? send_bytes : recv_bytes) <= kA2avDirectMaxBytes ? A2aAlgo::kDirect
                                                                                    : A2aAlgo::kPairwise;
}

// Sizes 8 B .. 1 GiB (powers of two) at which the choice changes, with the new choice; the
// first entry is the choice at 8 B.
struct Crossover {
  size_t bytes;
  Algo algo;
};
std::vector<Crossover> crossovers(int n, const CostParams& p);
std::string describe_crossovers(int n, const CostParams& p);
std::vector<Crossover> crossovers(const HostLayout& layout, const CostModel& m);
std::string describe_crossovers(const HostLayout& layout, const CostModel& m);

}  // namespace trn
