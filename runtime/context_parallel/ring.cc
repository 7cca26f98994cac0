#include "runtime/context_parallel/attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/kernels/kernels.h"
#include "runtime/util/trace.h"

namespace trn::cp {

namespace {

// The scratch buffers of one call (Group::buffer indices).
enum Buf { kCur = kRingBuffers, kNext, kPartOut, kPartLse, kSend0, kSend1, kIn, kRowTerms };

// The shape of one call: B sequences of Tn = 2L tokens, qkv rows of R, output rows of OC, packed
// key-value rows of W (a token's K key heads, then its K value heads: adjacent in a qkv row).
struct Shape {
  int B, Tn, L, H, K, hd;
  int64_t R, OC, W;
  size_t block;  // floats of one rank's keys and values
  Shape(int B_, int Tn_, int H_, int K_, int hd_)
      : B(B_), Tn(Tn_), L(Tn_ / 2), H(H_), K(K_), hd(hd_), R(int64_t(H_ + 2 * K_) * hd_), OC(int64_t(H_) * hd_),
        W(2 * int64_t(K_) * hd_), block(size_t(B_) * Tn_ * W) {}
};

// This rank's keys and values, packed by token.
void pack_kv(float* kv, const float* qkv, const Shape& s) {
  for (int64_t t = 0; t < int64_t(s.B) * s.Tn; ++t)
    std::memcpy(kv + t * s.W, qkv + t * s.R + s.OC, sizeof(float) * size_t(s.W));
}

// Query chunk a (0: head, 1: tail) of rank r, and key chunk c of rank j, as sequence chunk indices.
inline int chunk_of(int rank, int n, int half) { return half == 0 ? rank : 2 * n - 1 - rank; }

// o, l (rows of stride os; lse H rows of stride ls) become the softmax over both their keys and
// the partial po, pl's (L rows, stride os; lse H rows of L): each weighted by its share of the
// merged sum exp(l).
void merge(float* o, int64_t os, float* l, int64_t ls, const float* po, const float* pl, const Shape& s) {
  for (int h = 0; h < s.H; ++h)
    for (int i = 0; i < s.L; ++i) {
      const float la = l[int64_t(h) * ls + i], lp = pl[int64_t(h) * s.L + i];
      const float m = std::max(la, lp);
      const float wa = std::exp(la - m), wp = std::exp(lp - m), sum = wa + wp;
      l[int64_t(h) * ls + i] = m + std::log(sum);
      const float a = wa / sum, b = wp / sum;
      float* orow = o + i * os + int64_t(h) * s.hd;
      const float* prow = po + i * os + int64_t(h) * s.hd;
      for (int x = 0; x < s.hd; ++x) orow[x] = a * orow[x] + b * prow[x];
    }
}

// Products of one block: a causal block's rows see 1 .. L keys, another's L each.
double block_products(const Shape& s, bool causal) {
  return double(s.H) * (causal ? double(s.L) * (s.L + 1) / 2 : double(s.L) * s.L);
}

}  // namespace

void ring_attention_forward(Group& group, float* out, float* lse, const float* qkv, int B, int Tn, int H, int K, int hd) {
  trace::Span span("cp ring attention", "cp", {{"tokens", int64_t(B) * Tn}});
  const Shape s(B, Tn, H, K, hd);
  const int n = group.size(), r = group.rank();
  float* cur = group.buffer(kCur, s.block);
  float* next = group.buffer(kNext, s.block);
  float* po = group.buffer(kPartOut, size_t(s.L) * s.OC);
  float* pl = group.buffer(kPartLse, size_t(s.H) * s.L);
  pack_kv(cur, qkv, s);
  std::vector<char> have(size_t(B) * 2, 0);  // a query chunk has its first block's result
  for (int step = 0; step < n; ++step) {
    const int j = (r - step + n) % n;
    int sent = -1, got = -1;
    if (step < n - 1) {
      sent = group.send_next(cur, s.block);
      got = group.recv_prev(next, s.block);
    }
    for (int b = 0; b < B; ++b)
      for (int a = 0; a < 2; ++a)
        for (int c = 0; c < 2; ++c) {
          const int qc = chunk_of(r, n, a), kc = chunk_of(j, n, c);
          if (kc > qc) continue;  // masked whole
          const bool causal = kc == qc;
          const float* q = qkv + (int64_t(b) * Tn + a * s.L) * s.R;
          const float* k = cur + (int64_t(b) * Tn + c * s.L) * s.W;
          const float* v = k + int64_t(K) * hd;
          float* o = out + (int64_t(b) * Tn + a * s.L) * s.OC;
          float* l = lse + int64_t(b) * H * Tn + a * s.L;
          char& first = have[size_t(b) * 2 + a];
          if (!first) {
            kernels::attention_block_forward(o, s.OC, l, Tn, q, s.R, k, v, s.W, s.L, s.L, causal, H, K, hd);
            first = 1;
          } else {
            kernels::attention_block_forward(po, s.OC, pl, s.L, q, s.R, k, v, s.W, s.L, s.L, causal, H, K, hd);
            merge(o, s.OC, l, Tn, po, pl, s);
          }
          group.products() += block_products(s, causal);
        }
    if (step < n - 1) {
      group.wait(sent);
      group.wait(got);
      std::swap(cur, next);
    }
  }
  group.wait_all();
}

void ring_attention_backward(Group& group, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int Tn, int H, int K, int hd) {
  trace::Span span("cp ring attention backward", "cp", {{"tokens", int64_t(B) * Tn}});
  const Shape s(B, Tn, H, K, hd);
  const int n = group.size(), r = group.rank();
  float* cur = group.buffer(kCur, s.block);
  float* next = group.buffer(kNext, s.block);
  float* send[2] = {group.buffer(kSend0, s.block), group.buffer(kSend1, s.block)};
  float* in = group.buffer(kIn, s.block);
  float* D = group.buffer(kRowTerms, size_t(B) * H * Tn);
  // The row terms D = dout . out of the whole attention, and dq from zero (every block adds).
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < Tn; ++t) {
        const int64_t at = (int64_t(b) * Tn + t) * s.OC + int64_t(h) * hd;
        float d = 0;
        for (int x = 0; x < hd; ++x) d += dout[at + x] * out[at + x];
        D[(int64_t(b) * H + h) * Tn + t] = d;
      }
  for (int64_t t = 0; t < int64_t(B) * Tn; ++t) std::fill_n(dqkv + t * s.R, s.OC, 0.0f);
  pack_kv(cur, qkv, s);
  int sent_grad[2] = {-1, -1};
  for (int step = 0; step < n; ++step) {
    const int j = (r - step + n) % n;
    // In the order rank r - 1 sends: the sum of block j's gradient so far (its step - 1), then the
    // keys and values of the next block.
    const int got_grad = step >= 1 ? group.recv_prev(in, s.block) : -1;
    int sent = -1, got = -1;
    if (step < n - 1) {
      sent = group.send_next(cur, s.block);
      got = group.recv_prev(next, s.block);
    }
    float* mine = send[step % 2];
    if (sent_grad[step % 2] >= 0) group.wait(sent_grad[step % 2]);  // its send two steps ago
    std::fill_n(mine, s.block, 0.0f);
    for (int b = 0; b < B; ++b)
      for (int a = 0; a < 2; ++a)
        for (int c = 0; c < 2; ++c) {
          const int qc = chunk_of(r, n, a), kc = chunk_of(j, n, c);
          if (kc > qc) continue;
          const bool causal = kc == qc;
          const int64_t qrow = int64_t(b) * Tn + a * s.L, krow = int64_t(b) * Tn + c * s.L;
          const int64_t row_term = int64_t(b) * H * Tn + a * s.L;
          float* dk = mine + krow * s.W;
          kernels::attention_block_backward(dqkv + qrow * s.R, s.R, dk, dk + int64_t(K) * hd, s.W,
                                            dout + qrow * s.OC, s.OC, D + row_term, lse + row_term, Tn,
                                            qkv + qrow * s.R, s.R, cur + krow * s.W,
                                            cur + krow * s.W + int64_t(K) * hd, s.W, s.L, s.L, causal, H, K, hd);
          group.products() += block_products(s, causal);
        }
    if (got_grad >= 0) {
      group.wait(got_grad);
      for (size_t i = 0; i < s.block; ++i) mine[i] += in[i];
    }
    sent_grad[step % 2] = group.send_next(mine, s.block);
    if (step < n - 1) {
      group.wait(sent);
      group.wait(got);
      std::swap(cur, next);
    }
  }
  // This rank's own block, summed over every rank's queries, comes back from rank r - 1.
  group.wait(group.recv_prev(in, s.block));
  for (int64_t t = 0; t < int64_t(B) * Tn; ++t)
    std::memcpy(dqkv + t * s.R + s.OC, in + t * s.W, sizeof(float) * size_t(s.W));
  group.wait_all();
}

double ring_scratch_floats(int B, int Tn, int H, int K, int hd) {
  const Shape s(B, Tn, H, K, hd);
  // Backward holds the most: two key-value blocks, two outgoing gradient sums and an incoming one,
  // and the row terms; the forward's partial output is smaller than a block's gradient.
  return 5.0 * double(s.block) + double(B) * H * Tn;
}

}  // namespace trn::cp
