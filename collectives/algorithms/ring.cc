// Ring reduce-scatter / all-gather, chunked and pipelined: each segment travels in chunks, and a
// chunk is forwarded to the right neighbour as soon as it has been received (and reduced), so
// sends, receives and reductions of different chunks overlap.
//
// Receives are posted a window ahead, in the order they are consumed. Reduce-scatter receives
// land in a ring of scratch slots small enough to stay in cache: a chunk is reduced while it is
// still hot and its slot is reused, so the reduction reads the arriving data from cache rather
// than from memory. All-gather receives land in place. Out of place, the reduction reads this
// rank's contribution straight from the input (out = in op received), so no copy of the input
// is made first.
#include <algorithm>
#include <cstring>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {
namespace {

constexpr size_t kMaxChunksPerSegment = 4096;  // keeps step tags of in-flight messages distinct
// Bytes of receives in flight: a few chunks, within a core's L2.
constexpr size_t kWindowBytes = 1024 * 1024;
constexpr size_t kMaxWindow = 64;

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

void ring(Context& c, const char* in, char* buf, const std::vector<size_t>& seg, DataType t,
          ReduceOp op, bool do_rs, bool do_ag, int offset) {
  const int n = c.size(), r = c.rank();
  if (n == 1) return;
  const size_t es = size_of(t);
  size_t max_seg = 0;
  for (int i = 0; i < n; ++i) max_seg = std::max(max_seg, seg[i + 1] - seg[i]);
  const size_t max_elems = max_seg / es;
  size_t chunks = std::clamp<size_t>((max_seg + c.chunk_bytes() - 1) / std::max<size_t>(c.chunk_bytes(), 1),
                                     1, kMaxChunksPerSegment);
  chunks = std::min(chunks, std::max<size_t>(max_elems, 1));
  // Chunks start 64 bytes apart (for elements that divide 64), so that chunks of an aligned
  // segment stay aligned on the wire (core/aligned.h).
  const size_t align_elems = kBufferAlign % es == 0 ? kBufferAlign / es : 1;
  const size_t chunk_elems = ((max_elems + chunks - 1) / chunks + align_elems - 1) / align_elems * align_elems;
  if (chunk_elems) chunks = std::max<size_t>((max_elems + chunk_elems - 1) / chunk_elems, 1);
  const size_t chunk_max = std::max<size_t>(chunk_elems * es, 1);
  const int rs_steps = do_rs ? n - 1 : 0;
  const int steps = rs_steps + (do_ag ? n - 1 : 0);
  const size_t total = static_cast<size_t>(steps) * chunks;
  const int owned = do_rs ? r + 1 + offset : r;
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const char* src = in ? in : buf;  // this rank's contribution

  auto send_seg = [&](int step) {
    return step < rs_steps ? mod(r - step + offset, n) : mod(owned - (step - rs_steps), n);
  };
  auto recv_seg = [&](int step) { return send_seg(step + 1); };
  // Byte range of chunk j of segment s.
  auto chunk = [&](int s, size_t j) {
    size_t len = seg[s + 1] - seg[s];
    size_t b = std::min(len, j * chunk_max), e = std::min(len, (j + 1) * chunk_max);
    return std::pair<size_t, size_t>{seg[s] + b, e - b};
  };
  auto step_tag = [&](int step, size_t j) { return static_cast<uint64_t>(step) * chunks + j; };

  const size_t window = std::clamp<size_t>(kWindowBytes / chunk_max, 2, kMaxWindow);
  char* slots = do_rs ? c.scratch(window * chunk_max) : nullptr;
  auto slot = [&](size_t k) { return slots + (k % window) * chunk_max; };

  std::vector<RequestPtr> sends(total), recvs(total);
  size_t posted = 0;  // receives are posted in consumption order, k = step * chunks + j
  auto post_recvs_until = [&](size_t limit) {
    for (; posted < std::min(limit, total); ++posted) {
      const int step = static_cast<int>(posted / chunks);
      const size_t j = posted % chunks;
      auto [off, len] = chunk(recv_seg(step), j);
      if (step < rs_steps) {
        recvs[posted] = c.irecv(left, step_tag(step, j), slot(posted), len);
        continue;
      }
      // This region was sent from buf during reduce-scatter; that send must finish before it is
      // overwritten (out of place, the first step sent from the input instead).
      const int sent_at = step - rs_steps;
      if (do_rs && !(in && sent_at == 0)) c.wait(sends[sent_at * chunks + j]);
      recvs[posted] = c.irecv(left, step_tag(step, j), buf + off, len);
    }
  };
  auto post_send = [&](int step, size_t j) {
    auto [off, len] = chunk(send_seg(step), j);
    sends[step * chunks + j] = c.isend(right, step_tag(step, j), (step == 0 ? src : buf) + off, len);
  };

  for (size_t j = 0; j < chunks; ++j) post_send(0, j);
  post_recvs_until(window);
  for (size_t k = 0; k < total; ++k) {
    const int step = static_cast<int>(k / chunks);
    const size_t j = k % chunks;
    c.wait(recvs[k]);
    recvs[k].reset();
    if (step < rs_steps) {
      auto [off, len] = chunk(recv_seg(step), j);
      reduce(buf + off, src + off, slot(k), len / es, t, op);
    }
    if (step + 1 < steps) post_send(step + 1, j);
    post_recvs_until(k + 1 + window);
  }
  c.wait_all(sends);
}

void allreduce_ring(Context& c, const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  const int n = c.size();
  const size_t es = size_of(t);
  if (n == 1) {
    if (in != out && count) std::memcpy(out, in, count * es);
    return;
  }
  // Segments start on 64-byte boundaries of the buffer where the elements allow it, so that an
  // aligned buffer sends and receives aligned messages (core/aligned.h); only from 64 cache
  // lines per rank on, where moving a boundary by up to 63 bytes unbalances nothing.
  const size_t align = kBufferAlign % es == 0 && count >= 64 * kBufferAlign * n ? kBufferAlign / es : 1;
  std::vector<size_t> seg(n + 1);
  for (int i = 0; i <= n; ++i) seg[i] = (i == n ? count : part_begin(count, n, i) / align * align) * es;
  const char* src = in == out ? nullptr : static_cast<const char*>(in);
  ring(c, src, static_cast<char*>(out), seg, t, op, true, true, 0);
}

void all_gather_ring(Context& c, void* buf, size_t block_bytes) {
  const int n = c.size();
  std::vector<size_t> seg(n + 1);
  for (int i = 0; i <= n; ++i) seg[i] = block_bytes * i;
  ring(c, nullptr, static_cast<char*>(buf), seg, DataType::kU8, ReduceOp::kSum, false, true, 0);
}

}  // namespace trn::algo
