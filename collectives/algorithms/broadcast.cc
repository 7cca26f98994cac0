// Broadcast. Up to kTreeBytes: a binomial tree (ceil(log2 n) message latencies). Larger: a
// chain root -> root+1 -> ... in chunks, each chunk forwarded as soon as it arrives, so the
// chain streams at link speed after a short fill.
#include <algorithm>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {
namespace {

constexpr size_t kTreeBytes = 64 * 1024;
constexpr size_t kMaxChunks = 16384;
constexpr size_t kRecvWindow = 8;

void broadcast_binomial(Context& c, char* buf, size_t bytes, int root) {
  const int n = c.size();
  const int v = (c.rank() - root + n) % n;  // position relative to root
  std::vector<RequestPtr> sends;
  int mask = 1;
  while (mask < n && v >= mask) mask <<= 1;
  // v in [mask/2, mask): receive from v - mask/2 (root has v == 0 and receives nothing).
  if (v != 0) c.wait(c.irecv((v - mask / 2 + root) % n, 0, buf, bytes));
  for (; mask < n; mask <<= 1)
    if (v + mask < n) sends.push_back(c.isend((v + mask + root) % n, 0, buf, bytes));
  c.wait_all(sends);
}

void broadcast_chain(Context& c, char* buf, size_t bytes, int root) {
  const int n = c.size();
  const int v = (c.rank() - root + n) % n;
  const int prev = (c.rank() - 1 + n) % n, next = (c.rank() + 1) % n;
  const size_t chunk = std::max(c.chunk_bytes(), (bytes + kMaxChunks - 1) / kMaxChunks);
  const size_t chunks = (bytes + chunk - 1) / chunk;
  auto range = [&](size_t j) { return std::pair<size_t, size_t>{j * chunk, std::min(chunk, bytes - j * chunk)}; };
  std::vector<RequestPtr> recvs(chunks), sends;
  auto post = [&](size_t j) {
    if (j < chunks && v != 0) recvs[j] = c.irecv(prev, j, buf + range(j).first, range(j).second);
  };
  for (size_t j = 0; j < kRecvWindow; ++j) post(j);
  for (size_t j = 0; j < chunks; ++j) {
    c.wait(recvs[j]);
    recvs[j].reset();
    post(j + kRecvWindow);
    if (v != n - 1) sends.push_back(c.isend(next, j, buf + range(j).first, range(j).second));
  }
  c.wait_all(sends);
}

}  // namespace

void broadcast(Context& c, void* buf, size_t bytes, int root) {
  if (c.size() == 1) return;
  if (bytes <= kTreeBytes || c.size() == 2)
    broadcast_binomial(c, static_cast<char*>(buf), bytes, root);
  else
    broadcast_chain(c, static_cast<char*>(buf), bytes, root);
}

}  // namespace trn::algo
