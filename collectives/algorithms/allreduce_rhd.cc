// Recursive halving-doubling all-reduce (Rabenseifner): a reduce-scatter by recursive halving
// (log2 p exchanges of halving size), then an all-gather by recursive doubling that retraces
// the same splits. For a world size n that is not a power of two, let p be the largest power of
// two below n and rem = n - p: first each even rank below 2*rem hands its whole vector to the
// odd rank above it (which reduces it and takes part), and at the end gets the result back.
// Up to doubling_max_bytes the p ranks skip the halving and exchange whole vectors by recursive
// doubling instead: log2 p messages rather than 2 log2 p, for latency-bound sizes (the
// communicator passes the cost model's crossover for its link; every rank the same).
// Every exchange reduces a op b on one side and b op a on the other, which are equal (the ops
// are commutative), so all ranks end bit-identical.
#include <algorithm>
#include <cstring>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {

void allreduce_rhd(Context& c, void* buf, size_t count, DataType t, ReduceOp op, size_t doubling_max_bytes) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const size_t es = size_of(t);
  char* data = static_cast<char*>(buf);
  int p = 1, levels = 0;
  while (p * 2 <= n) p *= 2, ++levels;
  const int rem = n - p;
  char* tmp = c.scratch(count * es);
  const uint64_t kFixIn = 0, kFixOut = 1, kLevel0 = 2;

  // Fix-up in: even ranks below 2*rem drop out after handing over their data.
  int vr;  // rank among the p participants, or -1
  if (r < 2 * rem) {
    if (r % 2 == 0) {
      c.wait(c.isend(r + 1, kFixIn, data, count * es));
      vr = -1;
    } else {
      c.wait(c.irecv(r - 1, kFixIn, tmp, count * es));
      reduce(data, tmp, count, t, op);
      vr = r / 2;
    }
  } else {
    vr = r - rem;
  }
  auto real = [&](int v) { return v < rem ? 2 * v + 1 : v + rem; };

  if (vr >= 0 && count * es <= doubling_max_bytes) {
    int level = 0;
    for (int mask = 1; mask < p; mask *= 2, ++level) {
      const int peer = real(vr ^ mask);
      auto rq = c.irecv(peer, kLevel0 + level, tmp, count * es);
      auto sq = c.isend(peer, kLevel0 + level, data, count * es);
      c.wait(rq);
      c.wait(sq);  // data is sent before it changes
      reduce(data, tmp, count, t, op);
    }
  } else if (vr >= 0) {
    // Recursive halving: at each level keep one half of [lo, hi) and send the other.
    std::vector<std::pair<size_t, size_t>> kept;  // range before each split
    size_t lo = 0, hi = count;
    int level = 0;
    for (int mask = p / 2; mask >= 1; mask /= 2, ++level) {
      const int peer = real(vr ^ mask);
      const size_t mid = lo + (hi - lo) / 2;
      kept.emplace_back(lo, hi);
      const bool lower = (vr & mask) == 0;
      size_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
      size_t give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
      auto rq = c.irecv(peer, kLevel0 + level, tmp, (keep_hi - keep_lo) * es);
      auto sq = c.isend(peer, kLevel0 + level, data + give_lo * es, (give_hi - give_lo) * es);
      c.wait(rq);
      reduce(data + keep_lo * es, tmp, keep_hi - keep_lo, t, op);
      c.wait(sq);
      lo = keep_lo;
      hi = keep_hi;
    }
    // Recursive doubling: exchange the owned range with the same partners in reverse order.
    for (int mask = 1; mask < p; mask *= 2) {
      --level;
      const int peer = real(vr ^ mask);
      auto [plo, phi] = kept[level];
      const size_t mid = plo + (phi - plo) / 2;
      const bool lower = (vr & mask) == 0;
      size_t other_lo = lower ? mid : plo, other_hi = lower ? phi : mid;
      auto rq = c.irecv(peer, kLevel0 + levels + level, data + other_lo * es, (other_hi - other_lo) * es);
      auto sq = c.isend(peer, kLevel0 + levels + level, data + lo * es, (hi - lo) * es);
      c.wait(rq);
      c.wait(sq);
      lo = plo;
      hi = phi;
    }
  }

  // Fix-up out.
  if (r < 2 * rem) {
    if (r % 2 == 0)
      c.wait(c.irecv(r + 1, kFixOut, data, count * es));
    else
      c.wait(c.isend(r - 1, kFixOut, data, count * es));
  }
}

}  // namespace trn::algo
