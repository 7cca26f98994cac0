// All-to-all by pairwise exchange: in step s rank r sends block (r + s) to rank r + s and
// receives block (r - s) from rank r - s; all steps are posted at once and awaited together.
#include <cstring>

#include "collectives/algorithms/algorithm.h"

namespace trn::algo {

void all_to_all_pairwise(Context& c, const void* in, void* out, size_t block_bytes) {
  const int n = c.size(), r = c.rank();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (src == dst && n > 1 && block_bytes) {  // in place: send from a copy
    char* copy = c.scratch(block_bytes * n, 1);
    std::memcpy(copy, src, block_bytes * n);
    src = copy;
  }
  if (block_bytes && dst + r * block_bytes != src + r * block_bytes)
    std::memmove(dst + r * block_bytes, src + r * block_bytes, block_bytes);
  std::vector<RequestPtr> reqs;
  for (int s = 1; s < n; ++s) {
    int from = (r - s + n) % n;
    reqs.push_back(c.irecv(from, 0, dst + from * block_bytes, block_bytes));
  }
  for (int s = 1; s < n; ++s) {
    int to = (r + s) % n;
    reqs.push_back(c.isend(to, 0, src + to * block_bytes, block_bytes));
  }
  c.wait_all(reqs);
}

}  // namespace trn::algo
