// Variable-size all-to-all (Communicator::all_to_all_v): exactly one message per ordered pair of
// ranks, empty ones too, all with step 0, so that a receiver always learns what its peer sent
// (a count that disagrees with the sender's fails the receive instead of dropping data) and the
// two algorithms below interoperate (cost_model.h, A2aAlgo). They differ only in how many
// messages are in flight:
//   direct    every receive, then every send, posted at once (in order of distance r + s, so that
//             the ranks do not all start with the same peer), then all awaited;
//   pairwise  in step s = 1 .. n - 1 exchange with r + s (send) and r - s (receive) and wait for
//             both before step s + 1.
#include <cstring>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"

namespace trn::algo {
namespace {

// Fails the exchange when a peer sent fewer bytes than this rank expected (more fails in the
// transport as a truncation).
void check_received(const RequestPtr& r, const Context& c, int from, size_t expected) {
  if (r->bytes() != expected)
    throw usage_error("all_to_all_v: rank {} sent {} bytes but rank {} expected {} (the sender's send_counts and "
                      "the receiver's recv_counts disagree)",
                      from, r->bytes(), c.rank(), expected);
}

}  // namespace

void all_to_all_v(Context& c, const AllToAllV& x, bool pairwise) {
  const int n = c.size(), r = c.rank();
  const char* src = x.in;
  // Own block: a local copy (the caller checked that both counts agree).
  if (x.send_bytes[r] && x.out + x.recv_off[r] != src + x.send_off[r])
    std::memmove(x.out + x.recv_off[r], src + x.send_off[r], x.send_bytes[r]);
  if (n == 1) return;
  if (pairwise) {
    std::vector<RequestPtr> reqs(2);
    for (int s = 1; s < n; ++s) {
      const int to = (r + s) % n, from = (r - s + n) % n;
      reqs[0] = c.irecv(from, 0, x.out + x.recv_off[from], x.recv_bytes[from]);
      reqs[1] = c.isend(to, 0, src + x.send_off[to], x.send_bytes[to]);
      c.wait(reqs[0]);
      check_received(reqs[0], c, from, x.recv_bytes[from]);
      c.wait(reqs[1]);
    }
    return;
  }
  std::vector<RequestPtr> recvs(n), sends(n);
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    recvs[from] = c.irecv(from, 0, x.out + x.recv_off[from], x.recv_bytes[from]);
  }
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    sends[to] = c.isend(to, 0, src + x.send_off[to], x.send_bytes[to]);
  }
  for (int s = 1; s < n; ++s) {
    const int from = (r - s + n) % n;
    c.wait(recvs[from]);
    check_received(recvs[from], c, from, x.recv_bytes[from]);
  }
  c.wait_all(sends);
}

}  // namespace trn::algo
