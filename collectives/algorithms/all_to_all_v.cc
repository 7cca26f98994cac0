// Variable-size all-to-all (Communicator::all_to_all_v, and all_to_all with equal blocks). Every
// ordered pair of ranks exchanges one message, empty ones too, in chunks of the pair's chunk
// (AllToAllV::chunk, the cost model's a2a_chunk_kib for their link; tag steps 0, 1, ...):
// floor(bytes / chunk) full chunks and a last one of bytes % chunk, possibly empty. So a
// message over shm travels through the rings in cache-sized pieces rather than as one long
// message (at 4-16 MiB per rank 2-9x faster, bench/results/2026-12-07-all-to-all-v.md), one
// over tcp in few long pieces that skip rxm's copies (cost_model.h), and a receiver whose count
// disagrees with its sender's always meets a chunk of the wrong length (short: this file's
// error; long: the transport's truncation) instead of dropping data. The
// two algorithms send the same chunks under the same tags and differ only in how many are in
// flight, so ranks may choose differently (cost_model.h, A2aAlgo):
//   direct    every receive, then every send, posted at once (in order of distance r + s, so that
//             the ranks do not all start with the same peer), then all awaited;
//   pairwise  in step s = 1 .. n - 1 exchange with r + s (send) and r - s (receive) and wait for
//             both before step s + 1.
#include <algorithm>
#include <cstring>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"

namespace trn::algo {
namespace {

constexpr size_t kMaxChunks = 4096;  // keeps the step tags of one message distinct

// The chunk size of a message of bytes with peer: the pair's chunk, larger when that would
// make more than kMaxChunks chunks. Sender and receiver compute it from their own counts.
size_t chunk_of(const Context& c, const AllToAllV& x, int peer, size_t bytes) {
  const size_t chunk = std::max<size_t>(x.chunk.empty() ? c.chunk_bytes() : x.chunk[peer], 1);
  return std::max(chunk, bytes / (kMaxChunks - 1) + 1);
}
// Full chunks and the last, shorter one (possibly empty).
size_t chunks_of(size_t bytes, size_t chunk) { return bytes / chunk + 1; }

// Posts the receives of the message from `from` (its chunks, steps 0, 1, ...) into reqs.
void post_recv(Context& c, const AllToAllV& x, int from, std::vector<RequestPtr>& reqs) {
  const size_t bytes = x.recv_bytes[from], chunk = chunk_of(c, x, from, bytes);
  for (size_t j = 0, n = chunks_of(bytes, chunk); j < n; ++j) {
    const size_t at = j * chunk;
    reqs.push_back(c.irecv(from, j, x.out + x.recv_off[from] + at, std::min(chunk, bytes - at)));
  }
}
void post_send(Context& c, const AllToAllV& x, const char* src, int to, std::vector<RequestPtr>& reqs) {
  const size_t bytes = x.send_bytes[to], chunk = chunk_of(c, x, to, bytes);
  for (size_t j = 0, n = chunks_of(bytes, chunk); j < n; ++j) {
    const size_t at = j * chunk;
    reqs.push_back(c.isend(to, j, src + x.send_off[to] + at, std::min(chunk, bytes - at)));
  }
}

}  // namespace

void all_to_all_v(Context& c, const AllToAllV& x, bool pairwise) {
  const int n = c.size(), r = c.rank();
  const char* src = x.in;
  // Own block: a local copy (the caller checked that both counts agree). It runs once this
  // rank's first messages are posted, while the peers take them: a copy made first (up to 2 MiB
  // at 4 MiB per rank on 2 ranks) delays every peer's first receive by its length, and with
  // pulled messages (ring_channel.h) the two ranks then took turns instead of copying together.
  bool own_copied = false;
  auto copy_own = [&] {
    if (own_copied) return;
    own_copied = true;
    if (x.send_bytes[r] && x.out + x.recv_off[r] != src + x.send_off[r])
      std::memmove(x.out + x.recv_off[r], src + x.send_off[r], x.send_bytes[r]);
  };
  if (n == 1) return copy_own();
  std::vector<RequestPtr> recvs, sends;
  std::vector<int> recv_from;  // the sender of each receive in recvs
  auto wait_recvs = [&] {
    for (size_t k = 0; k < recvs.size(); ++k) {
      c.wait(recvs[k]);
      const int from = recv_from[k];
      // Every chunk but the last is full: a sender that sent less fails the first short one.
      const size_t bytes = x.recv_bytes[from], chunk = chunk_of(c, x, from, bytes);
      const size_t j = k - static_cast<size_t>(std::find(recv_from.begin(), recv_from.end(), from) - recv_from.begin());
      const size_t expected = std::min(chunk, bytes - j * chunk);
      if (recvs[k]->bytes() != expected)
        throw usage_error("all_to_all_v: rank {} sent {} bytes in part {} of its message, but rank {} expected {} (the "
                          "sender's send_counts and the receiver's recv_counts disagree)",
                          from, recvs[k]->bytes(), j, r, expected);
    }
    recvs.clear();
    recv_from.clear();
  };
  auto post_recv_from = [&](int from) {
    post_recv(c, x, from, recvs);
    recv_from.resize(recvs.size(), from);
  };
  if (pairwise) {
    for (int s = 1; s < n; ++s) {
      post_recv_from((r - s + n) % n);
      post_send(c, x, src, (r + s) % n, sends);
      copy_own();
      wait_recvs();
      c.wait_all(sends);
    }
    return;
  }
  for (int s = 1; s < n; ++s) post_recv_from((r - s + n) % n);
  for (int s = 1; s < n; ++s) post_send(c, x, src, (r + s) % n, sends);
  copy_own();
  wait_recvs();
  c.wait_all(sends);
}

}  // namespace trn::algo
