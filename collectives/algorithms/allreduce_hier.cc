// Hierarchical all-reduce over ranks grouped by host (L ranks on each of H hosts):
//
//   1. reduce-scatter within each host (ring over its L ranks): the host's l-th rank ends with
//      piece l of L, reduced over the host;
//   2. all-reduce of piece l across hosts among the H ranks that hold it (the l-th rank of
//      every host, hosts in order of their lowest rank), by plan.cross;
//   3. all-gather within each host (ring): every rank ends with every piece.
//
// Only phase 2 crosses hosts, and it moves 1/L of the vector per rank, with the L ranks of a
// host sending at once; phases 1 and 3 stay on the host's fast links. Every rank of a piece's
// cross-host group holds the same bytes after phase 2 (each algorithm is deterministic), and
// phase 3 copies them, so every rank ends bit-identical. With one rank per host it is the cross
// phase alone; on one host, the ring.
//
// Tags: phases 1 and 3 exchange messages between the same neighbours, so phase 3 numbers its
// steps from kGatherBase; phase 2 runs between ranks of different hosts, which phases 1 and 3
// never pair, and takes kCrossBase for clarity.
#include <cstring>
#include <map>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"

namespace trn::algo {
namespace {

constexpr uint64_t kCrossBase = 0x4000;
constexpr uint64_t kGatherBase = 0x8000;

}  // namespace

void allreduce_hier(Context& c, const std::vector<int>& host_of, const void* in, void* out, size_t count,
                    DataType t, ReduceOp op, const HierPlan& plan) {
  const int n = c.size(), me = c.rank();
  const size_t es = size_of(t);
  if (n == 1 || count == 0) {
    if (in != out && count) std::memcpy(out, in, count * es);
    return;
  }

  // Members by host, hosts in order of their lowest member; members of a host in rank order.
  std::map<int, int> host_index;
  std::vector<std::vector<int>> hosts;  // communicator ranks of each host
  for (int i = 0; i < n; ++i) {
    auto [it, fresh] = host_index.emplace(host_of[i], static_cast<int>(hosts.size()));
    if (fresh) hosts.emplace_back();
    hosts[it->second].push_back(i);
  }
  const int H = static_cast<int>(hosts.size());
  const int L = static_cast<int>(hosts[0].size());
  for (const auto& h : hosts)
    if (static_cast<int>(h.size()) != L)
      throw internal_error("hierarchical all-reduce on an uneven layout ({})",
                           host_layout(host_of).describe());
  const int my_host = host_index.at(host_of[me]);
  int l = 0;
  while (hosts[my_host][l] != me) ++l;

  std::vector<int> local(L), cross(H);  // transport ranks
  for (int i = 0; i < L; ++i) local[i] = c.world_rank(hosts[my_host][i]);
  for (int h = 0; h < H; ++h) cross[h] = c.world_rank(hosts[h][l]);

  // L pieces; boundaries on 64-byte multiples where the elements allow it and the pieces are
  // long enough that this unbalances nothing (as allreduce_ring's segments).
  const size_t align = kBufferAlign % es == 0 && count >= 64 * kBufferAlign * L ? kBufferAlign / es : 1;
  std::vector<size_t> seg(L + 1);
  for (int i = 0; i <= L; ++i) seg[i] = (i == L ? count : part_begin(count, L, i) / align * align) * es;
  char* buf = static_cast<char*>(out);

  Context intra = c.subgroup(local, l).with_chunk_bytes(plan.intra_chunk);
  // Phase 1. Out of place the ring reads the input directly (no copy first).
  if (L > 1)
    ring(intra, in == out ? nullptr : static_cast<const char*>(in), buf, seg, t, op, true, false, -1);
  else if (in != out)
    std::memcpy(out, in, count * es);

  // Phase 2.
  if (H > 1) {
    Context x = c.subgroup(cross, my_host).with_step_base(kCrossBase);
    char* piece = buf + seg[l];
    const size_t piece_count = (seg[l + 1] - seg[l]) / es;
    switch (plan.cross) {
      case Algo::kTree:
        allreduce_tree(x, piece, piece_count, t, op);
        break;
      case Algo::kRhd:
        allreduce_rhd(x, piece, piece_count, t, op, plan.cross_doubling_max);
        break;
      default: {
        Context xr = x.with_chunk_bytes(plan.inter_chunk);
        allreduce_ring(xr, piece, piece, piece_count, t, op);
      }
    }
  }

  // Phase 3.
  if (L > 1) {
    Context gather = intra.with_step_base(kGatherBase);
    ring(gather, nullptr, buf, seg, t, op, false, true, 0);
  }
}

}  // namespace trn::algo
