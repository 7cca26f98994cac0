// Ring reduce-scatter: the ring core reading the input and writing partial sums to a working
// area (the input stays unchanged), arranged so that each rank ends up owning its own block.
#include <cstring>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {

void reduce_scatter_ring(Context& c, const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  const int n = c.size();
  const size_t block = count * size_of(t);
  if (n == 1) {
    if (out != in && block) std::memmove(out, in, block);
    return;
  }
  char* work = c.scratch(block * n, 1);
  std::vector<size_t> seg(n + 1);
  for (int i = 0; i <= n; ++i) seg[i] = block * i;
  ring(c, static_cast<const char*>(in), work, seg, t, op, true, false, -1);
  if (block) std::memcpy(out, work + block * c.rank(), block);
}

}  // namespace trn::algo
