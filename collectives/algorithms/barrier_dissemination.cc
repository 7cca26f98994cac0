// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank - 2^k;
// after ceil(log2 n) rounds every rank has (transitively) heard from every other.
#include "collectives/algorithms/algorithm.h"

namespace trn::algo {

void barrier_dissemination(Context& c) {
  const int n = c.size(), r = c.rank();
  char token = 0, sink = 0;
  for (int k = 0, dist = 1; dist < n; ++k, dist <<= 1) {
    auto rq = c.irecv((r - dist + n) % n, k, &sink, 1);
    auto sq = c.isend((r + dist) % n, k, &token, 1);
    c.wait(rq);
    c.wait(sq);
  }
}

}  // namespace trn::algo
