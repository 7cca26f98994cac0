// Reduce to a root along a pipelined chain: the rank farthest from the root sends its data
// chunk by chunk towards the root; each rank adds its own contribution to each chunk on the
// way (acc = own op acc_from_farther), so the order of reduction is fixed.
#include <algorithm>
#include <cstring>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {

void reduce_chain(Context& c, void* buf, size_t count, DataType t, ReduceOp op, int root) {
  const int n = c.size();
  if (n == 1) return;
  const size_t es = size_of(t), bytes = count * es;
  const int v = (c.rank() - root + n) % n;
  const int toward = (c.rank() - 1 + n) % n, from = (c.rank() + 1) % n;
  const size_t chunk_elems = std::max<size_t>(1, std::max(c.chunk_bytes(), bytes / 16384 + 1) / es);
  const size_t chunks = (count + chunk_elems - 1) / chunk_elems;
  // Non-root ranks accumulate in scratch so their buffer stays as given.
  char* acc = static_cast<char*>(buf);
  if (v != 0 && v != n - 1 && bytes) {
    acc = c.scratch(bytes, 1);
    std::memcpy(acc, buf, bytes);
  }
  constexpr size_t kWindow = 2;
  char* tmp = c.scratch(kWindow * chunk_elems * es, 0);
  std::vector<RequestPtr> recvs(chunks), sends;
  auto range = [&](size_t j) {
    size_t b = j * chunk_elems;
    return std::pair<size_t, size_t>{b, std::min(chunk_elems, count - b)};
  };
  auto post = [&](size_t j) {
    if (j < chunks && v != n - 1)
      recvs[j] = c.irecv(from, j, tmp + (j % kWindow) * chunk_elems * es, range(j).second * es);
  };
  for (size_t j = 0; j < kWindow; ++j) post(j);
  for (size_t j = 0; j < chunks; ++j) {
    auto [b, len] = range(j);
    if (v != n - 1) {
      c.wait(recvs[j]);
      recvs[j].reset();
      reduce(acc + b * es, tmp + (j % kWindow) * chunk_elems * es, len, t, op);
      post(j + kWindow);
    }
    if (v != 0) sends.push_back(c.isend(toward, j, acc + b * es, len * es));
  }
  c.wait_all(sends);
}

}  // namespace trn::algo
