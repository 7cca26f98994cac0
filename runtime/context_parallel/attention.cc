#include "runtime/context_parallel/attention.h"

namespace trn::cp {

void attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K, int hd) {
  if (group.mode() == Comm::kAllToAll) return ulysses_attention_forward(group, out, lse, qkv, B, Tn, H, K, hd);
  ring_attention_forward(group, out, lse, qkv, B, Tn, H, K, hd);
}

void attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int Tn, int H, int K, int hd) {
  if (group.mode() == Comm::kAllToAll)
    return ulysses_attention_backward(group, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
  ring_attention_backward(group, dqkv, dout, qkv, out, lse, B, Tn, H, K, hd);
}

double scratch_bytes(Comm mode, int B, int Tn, int H, int K, int hd, bool widened) {
  double floats =
      mode == Comm::kAllToAll ? ulysses_scratch_floats(B, Tn, H, K, hd) : ring_scratch_floats(B, Tn, H, K, hd);
  if (widened) floats += double(B) * Tn * (double(H + 2 * K) * hd + double(H) * hd);  // q, k, v and the output
  return 4 * floats;
}

}  // namespace trn::cp
