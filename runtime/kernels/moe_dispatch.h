// Expert parallelism's token movement, without the communication: what each rank of an
// expert-parallel group of P ranks sends where, the packing and unpacking of the rows, the
// grouping of received rows by local expert, and the combines on both sides. The caller moves
// the packed buffers with a variable-size all-to-all (Communicator::all_to_all_v), whose per-peer
// counts are rows times the widths below.
//
// Rank q holds experts [q * El, (q + 1) * El). A token goes once to each rank holding any of its
// kept choices (not once per choice): the row carries the token's activations and, for each of
// its choices on that rank, the local expert and the combine weight. The destination groups the
// rows it received by local expert, runs each expert over its rows, and sends back one row per
// received row, already combined over the choices it holds; the source adds the rows that come
// back. Backward runs the same way in reverse, and the combine weights' gradients travel back
// with the input gradients.
//
//   dispatch  source -> destination  [x (C) | weight (k) | local expert (k), -1 padded]  C + 2k
//   return    destination -> source  [sum of weight * y over the row's choices (C)]      C
//   backward  source -> destination  [dout (C)]                                           C
//   return    destination -> source  [dx (C) | dweight (k)]                               C + k
//
// Local expert indices travel as values of T: exact for any index below 2^24, so one buffer per
// direction carries a row and its metadata. Sent rows are grouped by destination, each group in
// token order; received rows are in (source rank, token) order, and so is each expert's group.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/kernels/moe.h"

namespace trn::kernels::moe {

template <typename T>
struct Dispatch {
  int P = 1, El = 0, k = 0;
  // The source side.
  std::vector<int> send_rows;        // (P) rows sent to each rank
  std::vector<int32_t> sent_token;   // (S) the token of each sent row
  std::vector<int32_t> sent_choice;  // (S, k) n * k + j of each choice the row carries, -1 padded
  // The destination side.
  std::vector<int> recv_rows;     // (P) rows received from each rank
  std::vector<int32_t> expert;    // (R, k) each received row's local experts, -1 padded
  std::vector<T> weight;          // (R, k) and their combine weights
  std::vector<int32_t> offset;    // (El + 1) local expert e's grouped rows are [offset[e], offset[e+1])
  std::vector<int32_t> pair;      // (R, k) the grouped row of each (received row, choice), -1 padded
  std::vector<int32_t> row;       // (G) the received row each grouped row copies

  int sent() const { return int(sent_token.size()); }
  int received() const { return int(expert.size()) / (k ? k : 1); }
  int grouped() const { return offset.empty() ? 0 : offset[size_t(El)]; }
  static int dispatch_width(int C, int k) { return C + 2 * k; }
  static int return_width(int C, int k) { return C + k; }
};

// The source's plan from its routing (r.E experts over P ranks, P dividing r.E), and the
// dispatch buffer (sent() x dispatch_width) packed from x (N, C).
template <typename T>
void plan_dispatch(Dispatch<T>& d, std::vector<T>& buf, const Routing<T>& r, const T* x, int C, int P) {
  const int k = r.k, El = r.E / P;
  d.P = P;
  d.El = El;
  d.k = k;
  d.send_rows.assign(size_t(P), 0);
  d.sent_token.clear();
  d.sent_choice.clear();
  buf.clear();
  const int W = Dispatch<T>::dispatch_width(C, k);
  for (int q = 0; q < P; ++q)
    for (int n = 0; n < r.N; ++n) {
      int m = 0;  // this token's choices on rank q
      for (int j = 0; j < k; ++j) {
        const size_t i = size_t(n) * k + j;
        if (r.slot[i] >= 0 && r.choice[i] / El == q) {
          if (m == 0) {
            ++d.send_rows[size_t(q)];
            d.sent_token.push_back(n);
            d.sent_choice.insert(d.sent_choice.end(), size_t(k), -1);
            const size_t at = buf.size();
            buf.resize(at + size_t(W), T(-1));
            std::copy_n(x + size_t(n) * C, C, buf.data() + at);
          }
          T* meta = buf.data() + buf.size() - size_t(W) + C;
          meta[m] = r.weight[i];
          meta[k + m] = T(r.choice[i] - q * El);
          d.sent_choice[d.sent_choice.size() - size_t(k) + size_t(m)] = int32_t(i);
          ++m;
        }
      }
      if (m > 0) {  // unused weight slots: 0 (the -1 padding marks only the experts)
        T* meta = buf.data() + buf.size() - size_t(W) + C;
        for (int s = m; s < k; ++s) meta[s] = T(0);
      }
    }
}

// The destination's side of a received dispatch buffer (recv_rows set by the caller): the
// metadata and the grouping by local expert. Returns grouped().
template <typename T>
int plan_received(Dispatch<T>& d, const T* buf, int C) {
  const int k = d.k, W = Dispatch<T>::dispatch_width(C, k);
  int R = 0;
  for (int c : d.recv_rows) R += c;
  d.expert.assign(size_t(R) * k, -1);
  d.weight.assign(size_t(R) * k, T(0));
  d.pair.assign(size_t(R) * k, -1);
  d.offset.assign(size_t(d.El) + 1, 0);
  for (int rr = 0; rr < R; ++rr) {
    const T* meta = buf + size_t(rr) * W + C;
    for (int s = 0; s < k; ++s) {
      if (meta[k + s] < T(0)) break;
      const int e = int(meta[k + s]);
      d.expert[size_t(rr) * k + s] = e;
      d.weight[size_t(rr) * k + s] = meta[s];
      ++d.offset[size_t(e) + 1];
    }
  }
  for (int e = 0; e < d.El; ++e) d.offset[size_t(e) + 1] += d.offset[size_t(e)];
  std::vector<int32_t> next(d.offset.begin(), d.offset.end() - 1);
  d.row.assign(size_t(d.grouped()), 0);
  for (int rr = 0; rr < R; ++rr)
    for (int s = 0; s < k; ++s) {
      const int e = d.expert[size_t(rr) * k + s];
      if (e < 0) break;
      const int32_t g = next[size_t(e)]++;
      d.pair[size_t(rr) * k + s] = g;
      d.row[size_t(g)] = rr;
    }
  return d.grouped();
}

// xs (grouped() x C): each grouped row its received row's activations.
template <typename T>
void gather_received(T* xs, const T* buf, const Dispatch<T>& d, int C) {
  const int W = Dispatch<T>::dispatch_width(C, d.k);
  for (int g = 0; g < d.grouped(); ++g) std::copy_n(buf + size_t(d.row[size_t(g)]) * W, C, xs + size_t(g) * C);
}

// Both: the plan and xs grouped.
template <typename T>
void group_received(Dispatch<T>& d, std::vector<T>& xs, const T* buf, int C) {
  xs.resize(size_t(plan_received(d, buf, C)) * C);
  gather_received(xs.data(), buf, d, C);
}

// back (received() x C): each received row's weighted sum of its experts' outputs ys (grouped() x C).
template <typename T>
void combine_received(T* back, const T* ys, const Dispatch<T>& d, int C) {
  for (int rr = 0; rr < d.received(); ++rr) {
    T* o = back + size_t(rr) * C;
    std::fill(o, o + C, T(0));
    for (int s = 0; s < d.k; ++s) {
      const int32_t g = d.pair[size_t(rr) * d.k + s];
      if (g < 0) break;
      const T w = d.weight[size_t(rr) * d.k + s];
      const T* y = ys + size_t(g) * C;
      for (int c = 0; c < C; ++c) o[c] += w * y[c];
    }
  }
}

// out (N, C) = the sum of the rows that came back (sent() x C, in sent order) at their tokens;
// tokens none of whose choices were kept get zeros.
template <typename T>
void combine_returned(T* out, const T* back, const Dispatch<T>& d, int N, int C) {
  std::fill(out, out + size_t(N) * C, T(0));
  for (int s = 0; s < d.sent(); ++s) {
    T* o = out + size_t(d.sent_token[size_t(s)]) * C;
    const T* b = back + size_t(s) * C;
    for (int c = 0; c < C; ++c) o[c] += b[c];
  }
}

// Backward, source: the output gradient's rows as dispatched (sent() x C).
template <typename T>
void pack_output_grad(T* buf, const T* dout, const Dispatch<T>& d, int C) {
  for (int s = 0; s < d.sent(); ++s) std::copy_n(dout + size_t(d.sent_token[size_t(s)]) * C, C, buf + size_t(s) * C);
}

// Backward, destination: from the received output gradients dback (received() x C) and the
// forward's ys, dys (grouped() x C) = weight * dout and the weights' gradients dout . y into the
// return buffer's dweight columns (received() x return_width; the dx columns are filled by
// return_input_grad). Under tensor parallelism ys, and so dweight, are partial sums.
template <typename T>
void combine_received_backward(T* dys, T* ret, const T* dback, const T* ys, const Dispatch<T>& d, int C) {
  const int k = d.k, W = Dispatch<T>::return_width(C, k);
  for (int rr = 0; rr < d.received(); ++rr) {
    const T* g = dback + size_t(rr) * C;
    T* dw = ret + size_t(rr) * W + C;
    for (int s = 0; s < k; ++s) {
      const int32_t p = d.pair[size_t(rr) * k + s];
      dw[s] = T(0);
      if (p < 0) continue;
      const T w = d.weight[size_t(rr) * k + s];
      const T* y = ys + size_t(p) * C;
      T* dy = dys + size_t(p) * C;
      T dot = 0;
      for (int c = 0; c < C; ++c) {
        dy[c] = w * g[c];
        dot += g[c] * y[c];
      }
      dw[s] = dot;
    }
  }
}

// Backward, destination: each received row's input gradient, the sum over its choices of the
// grouped rows' dxs (grouped() x C), into the return buffer's dx columns.
template <typename T>
void return_input_grad(T* ret, const T* dxs, const Dispatch<T>& d, int C) {
  const int k = d.k, W = Dispatch<T>::return_width(C, k);
  for (int rr = 0; rr < d.received(); ++rr) {
    T* o = ret + size_t(rr) * W;
    std::fill(o, o + C, T(0));
    for (int s = 0; s < k; ++s) {
      const int32_t p = d.pair[size_t(rr) * k + s];
      if (p < 0) break;
      const T* g = dxs + size_t(p) * C;
      for (int c = 0; c < C; ++c) o[c] += g[c];
    }
  }
}

// Backward, source: dx (N, C) += the returned input gradients at their tokens, and dweight
// (N, k) (overwritten; 0 for dropped choices) from the returned columns.
template <typename T>
void scatter_returned(T* dx, T* dweight, const T* ret, const Dispatch<T>& d, int N, int C) {
  const int k = d.k, W = Dispatch<T>::return_width(C, k);
  std::fill(dweight, dweight + size_t(N) * k, T(0));
  for (int s = 0; s < d.sent(); ++s) {
    const T* g = ret + size_t(s) * W;
    T* o = dx + size_t(d.sent_token[size_t(s)]) * C;
    for (int c = 0; c < C; ++c) o[c] += g[c];
    for (int m = 0; m < k; ++m) {
      const int32_t i = d.sent_choice[size_t(s) * k + m];
      if (i < 0) break;
      dweight[size_t(i)] = g[C + m];
    }
  }
}

}  // namespace trn::kernels::moe
