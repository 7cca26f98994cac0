// Context-parallel attention by all-to-all (attention.h, "all-to-all"): the tokens' split becomes a
// split of the heads around the ordinary attention kernel, and back.
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/context_parallel/attention.h"
#include "runtime/kernels/kernels.h"
#include "runtime/util/trace.h"

namespace trn::cp {
namespace {

enum Buf { kSend = kUlyssesBuffers, kRecv, kSeqQkv, kSeqOut, kSeqGrad };

// One call's shape: N ranks, each with Tn = 2L of every sequence's T = N Tn tokens; a head group
// of H/N query heads and K/N KV heads (qkv rows of Rg), outputs of OCg.
struct Shape {
  int N, B, Tn, T, L, H, K, hd, Hg, Kg;
  int64_t R, OC, Rg, OCg;
  Shape(int n, int B_, int Tn_, int H_, int K_, int hd_)
      : N(n), B(B_), Tn(Tn_), T(n * Tn_), L(Tn_ / 2), H(H_), K(K_), hd(hd_), Hg(H_ / n), Kg(K_ / n),
        R(int64_t(H_ + 2 * K_) * hd_), OC(int64_t(H_) * hd_), Rg(int64_t(H_ / n + 2 * (K_ / n)) * hd_),
        OCg(int64_t(H_ / n) * hd_) {
    if (H % n != 0 || K % n != 0)
      throw internal_error("all-to-all context parallelism over {} ranks with {} heads and {} KV heads", n, H, K);
  }
  // The position in its sequence of rank `rank`'s token t (model::Placement::position).
  int position(int rank, int t) const { return (t < L ? rank : 2 * N - 1 - rank) * L + t % L; }
  // Offsets of head group g's q, k and v in a qkv row of R, and of its part of an output row.
  int64_t q_at(int g) const { return int64_t(g) * Hg * hd; }
  int64_t k_at(int g) const { return OC + int64_t(g) * Kg * hd; }
  int64_t v_at(int g) const { return OC + int64_t(K) * hd + int64_t(g) * Kg * hd; }
};

// Each head group's q, k, v of this rank's tokens to that group's rank; the received tokens of
// every rank, for this rank's heads, into whole sequences in position order (B, T, Rg).
void gather_heads(Group& group, const Shape& s, const float* qkv, float* seq) {
  const size_t block = size_t(s.B) * s.Tn * s.Rg;
  float* send = group.buffer(kSend, block * s.N);
  float* recv = group.buffer(kRecv, block * s.N);
  const size_t q = size_t(s.Hg) * s.hd, kv = size_t(s.Kg) * s.hd;
  for (int g = 0; g < s.N; ++g)
    for (int64_t t = 0; t < int64_t(s.B) * s.Tn; ++t) {
      float* to = send + g * block + t * s.Rg;
      const float* row = qkv + t * s.R;
      std::memcpy(to, row + s.q_at(g), sizeof(float) * q);
      std::memcpy(to + q, row + s.k_at(g), sizeof(float) * kv);
      std::memcpy(to + q + kv, row + s.v_at(g), sizeof(float) * kv);
    }
  group.all_to_all(send, recv, block);
  for (int src = 0; src < s.N; ++src)
    for (int b = 0; b < s.B; ++b)
      for (int t = 0; t < s.Tn; ++t)
        std::memcpy(seq + (int64_t(b) * s.T + s.position(src, t)) * s.Rg,
                    recv + src * block + (int64_t(b) * s.Tn + t) * s.Rg, sizeof(float) * size_t(s.Rg));
}

// The reverse for rows of `width` floats per head group: whole sequences (B, T, width) of this
// rank's heads back to the tokens' ranks; each received group's rows handed to put(group, token
// row, values).
template <class Put>
void scatter_heads(Group& group, const Shape& s, const float* seq, int64_t width, Put&& put) {
  const size_t block = size_t(s.B) * s.Tn * width;
  float* send = group.buffer(kSend, block * s.N);
  float* recv = group.buffer(kRecv, block * s.N);
  for (int dst = 0; dst < s.N; ++dst)
    for (int b = 0; b < s.B; ++b)
      for (int t = 0; t < s.Tn; ++t)
        std::memcpy(send + dst * block + (int64_t(b) * s.Tn + t) * width,
                    seq + (int64_t(b) * s.T + s.position(dst, t)) * width, sizeof(float) * size_t(width));
  group.all_to_all(send, recv, block);
  for (int g = 0; g < s.N; ++g)
    for (int64_t t = 0; t < int64_t(s.B) * s.Tn; ++t) put(g, t, recv + g * block + t * width);
}

// Rows of this rank's tokens (B, Tn, stride) with head group g's part at at(g), width wide each,
// for two arrays side by side: [a's part | b's part] per token to every group, into whole
// sequences (B, T, 2 width).
void gather_pair(Group& group, const Shape& s, const float* a, const float* b, float* seq) {
  const int64_t width = s.OCg;
  const size_t block = size_t(s.B) * s.Tn * 2 * width;
  float* send = group.buffer(kSend, block * s.N);
  float* recv = group.buffer(kRecv, block * s.N);
  for (int g = 0; g < s.N; ++g)
    for (int64_t t = 0; t < int64_t(s.B) * s.Tn; ++t) {
      float* to = send + g * block + t * 2 * width;
      std::memcpy(to, a + t * s.OC + s.q_at(g), sizeof(float) * size_t(width));
      std::memcpy(to + width, b + t * s.OC + s.q_at(g), sizeof(float) * size_t(width));
    }
  group.all_to_all(send, recv, block);
  for (int src = 0; src < s.N; ++src)
    for (int bb = 0; bb < s.B; ++bb)
      for (int t = 0; t < s.Tn; ++t)
        std::memcpy(seq + (int64_t(bb) * s.T + s.position(src, t)) * 2 * width,
                    recv + src * block + (int64_t(bb) * s.Tn + t) * 2 * width, sizeof(float) * size_t(2 * width));
}

}  // namespace

void ulysses_attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K,
                               int hd) {
  trace::Span span("cp all-to-all attention", "cp", {{"tokens", int64_t(B) * Tn}});
  const Shape s(group.size(), B, Tn, H, K, hd);
  float* seq = group.buffer(kSeqQkv, size_t(B) * s.T * s.Rg);
  float* seq_out = group.buffer(kSeqOut, size_t(B) * s.T * s.OCg);
  gather_heads(group, s, qkv, seq);
  // lse: (B, H/N, T), as many floats as (B, H, Tn).
  kernels::attention_forward(seq_out, lse, seq, B, s.T, s.Hg, s.Kg, hd);
  group.products() += double(B) * s.Hg * double(s.T) * (s.T + 1) / 2;
  scatter_heads(group, s, seq_out, s.OCg, [&](int g, int64_t t, const float* v) {
    std::memcpy(out + t * s.OC + s.q_at(g), v, sizeof(float) * size_t(s.OCg));
  });
}

void ulysses_attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                                const float* lse, int B, int Tn, int H, int K, int hd) {
  trace::Span span("cp all-to-all attention backward", "cp", {{"tokens", int64_t(B) * Tn}});
  const Shape s(group.size(), B, Tn, H, K, hd);
  float* seq = group.buffer(kSeqQkv, size_t(B) * s.T * s.Rg);
  float* pair = group.buffer(kSeqOut, size_t(B) * s.T * 2 * s.OCg);
  float* grad = group.buffer(kSeqGrad, size_t(B) * s.T * (s.Rg + 2 * s.OCg));
  float* seq_out = grad + size_t(B) * s.T * s.Rg;
  float* seq_dout = seq_out + size_t(B) * s.T * s.OCg;
  gather_heads(group, s, qkv, seq);
  gather_pair(group, s, out, dout, pair);
  for (int64_t t = 0; t < int64_t(B) * s.T; ++t) {  // [out | dout] rows apart, as the kernel reads them
    std::memcpy(seq_out + t * s.OCg, pair + t * 2 * s.OCg, sizeof(float) * size_t(s.OCg));
    std::memcpy(seq_dout + t * s.OCg, pair + t * 2 * s.OCg + s.OCg, sizeof(float) * size_t(s.OCg));
  }
  kernels::attention_backward(grad, seq_dout, seq, seq_out, lse, B, s.T, s.Hg, s.Kg, hd);
  group.products() += double(B) * s.Hg * double(s.T) * (s.T + 1) / 2;
  const size_t q = size_t(s.Hg) * hd, kv = size_t(s.Kg) * hd;
  scatter_heads(group, s, grad, s.Rg, [&](int g, int64_t t, const float* v) {
    float* row = dqkv + t * s.R;
    std::memcpy(row + s.q_at(g), v, sizeof(float) * q);
    std::memcpy(row + s.k_at(g), v + q, sizeof(float) * kv);
    std::memcpy(row + s.v_at(g), v + q + kv, sizeof(float) * kv);
  });
}

double ulysses_scratch_floats(int B, int Tn, int H, int K, int hd) {
  // Backward holds the most: the send and receive blocks (every token's q, k, v once each), the
  // sequences' q, k, v, their output and its gradient side by side and apart, and dq, dk, dv.
  const double R = double(H + 2 * K) * hd, OC = double(H) * hd, n = double(B) * Tn;
  return n * (2 * R + R + 2 * OC + R + 2 * OC);
}

}  // namespace trn::cp
