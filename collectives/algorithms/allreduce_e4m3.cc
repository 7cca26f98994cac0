// All-reduce and reduce-scatter of f32 data with fp8 (E4M3, collectives/fp8.h) on the wire, for
// gradients: a quarter of an f32 ring all-reduce's bytes.
//
// A ring would re-encode each partial sum at every hop, compounding the rounding with the number
// of ranks. Instead each rank encodes its whole input once and an all-to-all hands part j of
// every rank's input to rank j, which decodes the size() parts and adds them in f32, in rank
// order. For the all-reduce, each rank then encodes its reduced part once more and a ring
// all-gather spreads the parts; every rank (the part's owner too) decodes the same bytes, so the
// results are bit-identical on every rank. Each value is rounded to e4m3 once on the way in and,
// for the all-reduce, once on the way out; the sums are f32 in a fixed order.
#include <algorithm>
#include <cstring>

#include "collectives/algorithms/algorithm.h"
#include "collectives/fp8.h"

namespace trn::algo {
namespace {

// The all-to-all's messages take steps from here, the ring all-gather's from 0, so the two phases'
// tags differ in any group of up to 16 ranks. In larger ones a ring tag may equal an all-to-all
// tag; that is still safe, because messages between two ranks match in issue order and every
// rank posts its all-to-all messages before its all-gather ones.
constexpr uint64_t kExchangeBase = 0xF000;

// Encodes parts[j] of src into dst at j * part_bytes for every rank j, exchanges them, and
// leaves the sum of every rank's part rank() in sum (f32, added in rank order).
void exchange_and_sum(Context& c, const float* src, float* residual, const std::vector<size_t>& parts,
                      size_t part_bytes, float* sum, bool avg, Fp8Format fmt) {
  const int n = c.size(), r = c.rank();
  char* send = c.scratch(part_bytes * n, 1);
  char* recv = c.scratch(part_bytes * n, 2);
  for (int j = 0; j < n; ++j) {
    if (residual)
      e4m3_encode_feedback(src + parts[j], residual + parts[j], parts[j + 1] - parts[j],
                           send + part_bytes * j, fmt);
    else
      e4m3_encode(src + parts[j], parts[j + 1] - parts[j], send + part_bytes * j, fmt);
  }
  Context x = c.with_step_base(kExchangeBase);
  all_to_all_pairwise(x, send, recv, part_bytes);
  const size_t len = parts[r + 1] - parts[r];
  e4m3_decode(recv, len, sum, fmt);
  for (int j = 1; j < n; ++j) e4m3_decode_add(recv + part_bytes * j, len, sum, fmt);
  if (avg)
    for (size_t i = 0; i < len; ++i) sum[i] /= static_cast<float>(n);
}

}  // namespace

void reduce_scatter_e4m3(Context& c, const float* in, float* out, size_t count, bool avg, float* residual,
                         Fp8Format fmt) {
  const int n = c.size();
  std::vector<size_t> parts(n + 1);
  for (int j = 0; j <= n; ++j) parts[j] = count * size_t(j);
  exchange_and_sum(c, in, residual, parts, e4m3_encoded_bytes(count), out, avg, fmt);
}

void allreduce_e4m3(Context& c, const float* in, float* out, size_t count, bool avg, float* residual,
                    Fp8Format fmt) {
  const int n = c.size(), r = c.rank();
  std::vector<size_t> parts(n + 1);
  for (int j = 0; j <= n; ++j) parts[j] = part_begin(count, n, j);
  size_t longest = 0;
  for (int j = 0; j < n; ++j) longest = std::max(longest, parts[j + 1] - parts[j]);
  const size_t part_bytes = e4m3_encoded_bytes(longest);
  // Everything of in is encoded before out is written, so in == out is safe.
  exchange_and_sum(c, in, residual, parts, part_bytes, out + parts[r], avg, fmt);
  char* gather = c.scratch(part_bytes * n, 1);  // the exchange's send area, free again
  e4m3_encode(out + parts[r], parts[r + 1] - parts[r], gather + part_bytes * r, fmt);
  all_gather_ring(c, gather, part_bytes);
  for (int j = 0; j < n; ++j)
    e4m3_decode(gather + part_bytes * j, parts[j + 1] - parts[j], out + parts[j], fmt);
}

}  // namespace trn::algo
