// Ring reduce-scatter / all-gather, chunked and pipelined: each segment travels in chunks, and a
// chunk is forwarded to the right neighbour as soon as it has been received (and reduced), so
// sends, receives and reductions of different chunks overlap. Receives are posted two steps
// ahead. Reduce-scatter receives land in a double-buffered scratch area; all-gather receives land
// in place.
#include <algorithm>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {
namespace {

constexpr size_t kMaxChunksPerSegment = 4096;  // keeps step tags of in-flight messages distinct

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

void ring(Context& c, char* buf, const std::vector<size_t>& seg, DataType t, ReduceOp op,
          bool do_rs, bool do_ag, int offset) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const size_t es = size_of(t);
  size_t max_seg = 0;
  for (int i = 0; i < n; ++i) max_seg = std::max(max_seg, seg[i + 1] - seg[i]);
  const size_t max_elems = max_seg / es;
  size_t chunks = std::clamp<size_t>((max_seg + c.chunk_bytes() - 1) / std::max<size_t>(c.chunk_bytes(), 1),
                                     1, kMaxChunksPerSegment);
  chunks = std::min(chunks, std::max<size_t>(max_elems, 1));
  const size_t chunk_elems = (max_elems + chunks - 1) / chunks;
  const int rs_steps = do_rs ? n - 1 : 0;
  const int steps = rs_steps + (do_ag ? n - 1 : 0);
  const int owned = do_rs ? r + 1 + offset : r;
  const int right = mod(r + 1, n), left = mod(r - 1, n);

  auto send_seg = [&](int step) {
    return step < rs_steps ? mod(r - step + offset, n) : mod(owned - (step - rs_steps), n);
  };
  auto recv_seg = [&](int step) { return send_seg(step + 1); };
  // Byte range of chunk j of segment s.
  auto chunk = [&](int s, size_t j) {
    size_t len = seg[s + 1] - seg[s];
    size_t b = std::min(len, j * chunk_elems * es), e = std::min(len, (j + 1) * chunk_elems * es);
    return std::pair<size_t, size_t>{seg[s] + b, e - b};
  };
  auto step_tag = [&](int step, size_t j) { return static_cast<uint64_t>(step) * chunks + j; };

  char* tmp = do_rs ? c.scratch(2 * chunks * chunk_elems * es) : nullptr;
  std::vector<RequestPtr> sends(static_cast<size_t>(steps) * chunks), recvs(sends.size());
  auto post_recv = [&](int step, size_t j) {
    auto [off, len] = chunk(recv_seg(step), j);
    if (step < rs_steps) {
      char* dst = tmp + ((step % 2) * chunks + j) * chunk_elems * es;
      recvs[step * chunks + j] = c.irecv(left, step_tag(step, j), dst, len);
    } else {
      // This region was sent during reduce-scatter; that send must finish before we overwrite it.
      if (do_rs) c.wait(sends[(step - rs_steps) * chunks + j]);
      recvs[step * chunks + j] = c.irecv(left, step_tag(step, j), buf + off, len);
    }
  };
  auto post_send = [&](int step, size_t j) {
    auto [off, len] = chunk(send_seg(step), j);
    sends[step * chunks + j] = c.isend(right, step_tag(step, j), buf + off, len);
  };

  for (size_t j = 0; j < chunks; ++j) post_send(0, j);
  for (int s = 0; s < std::min(steps, 2); ++s)
    for (size_t j = 0; j < chunks; ++j) post_recv(s, j);
  for (int step = 0; step < steps; ++step) {
    for (size_t j = 0; j < chunks; ++j) {
      RequestPtr& rq = recvs[step * chunks + j];
      c.wait(rq);
      rq.reset();
      if (step < rs_steps) {
        auto [off, len] = chunk(recv_seg(step), j);
        const char* src = tmp + ((step % 2) * chunks + j) * chunk_elems * es;
        reduce(buf + off, src, len / es, t, op);
      }
      if (step + 1 < steps) post_send(step + 1, j);
      if (step + 2 < steps) post_recv(step + 2, j);
    }
  }
  c.wait_all(sends);
}

void allreduce_ring(Context& c, void* buf, size_t count, DataType t, ReduceOp op) {
  const int n = c.size();
  const size_t es = size_of(t);
  std::vector<size_t> seg(n + 1);
  for (int i = 0; i <= n; ++i) seg[i] = part_begin(count, n, i) * es;
  ring(c, static_cast<char*>(buf), seg, t, op, true, true, 0);
}

void all_gather_ring(Context& c, void* buf, size_t block_bytes) {
  const int n = c.size();
  std::vector<size_t> seg(n + 1);
  for (int i = 0; i <= n; ++i) seg[i] = block_bytes * i;
  ring(c, static_cast<char*>(buf), seg, DataType::kU8, ReduceOp::kSum, false, true, 0);
}

}  // namespace trn::algo
