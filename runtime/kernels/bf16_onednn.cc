// The bf16 GEMM through oneDNN's matmul primitive (Debian's libdnnl, 2.x API): bf16 x bf16 with
// fp32 accumulation into an fp32 C, transposed operands and leading dimensions expressed as
// strides, beta as a sum post-op. On CPUs with AVX512-BF16 oneDNN runs it with its brgemm
// kernels (brg:avx512_core_bf16).
//
// Threads: the model runs one GEMM per compute thread, so every call is single-threaded. libdnnl
// is built on OpenMP; a thread's first call sets its OpenMP thread count to 1, so oneDNN neither
// splits a GEMM nor starts a team of its own.
//
// Primitives: creating one (descriptor, dispatch, JIT) costs microseconds even when oneDNN's own
// cache has it, so each thread keeps the primitives it made by shape. A model calls a few dozen
// shapes, and the same shapes every step.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/fastmath.h"

namespace trn::kernels {
namespace {

using dnnl::memory;

// Element strides of a matrix operand: between matrices of a batch, rows and columns.
struct Strides {
  int64_t batch, row, col;
};

// A matmul as oneDNN sees it: batch x (M,K) @ (K,N) -> (M,N), strides of A, B, C, and beta.
// batch 1 is a 2-D matmul (the batch strides unused).
struct Shape {
  int batch, M, N, K;
  Strides a, b, c;
  float beta;
  bool operator==(const Shape& o) const {
    auto same = [](Strides x, Strides y) { return x.batch == y.batch && x.row == y.row && x.col == y.col; };
    return batch == o.batch && M == o.M && N == o.N && K == o.K && same(a, o.a) && same(b, o.b) && same(c, o.c) &&
           std::memcmp(&beta, &o.beta, sizeof beta) == 0;
  }
};

struct ShapeHash {
  size_t operator()(const Shape& s) const {
    size_t h = 0;
    for (int64_t v : {int64_t(s.batch), int64_t(s.M), int64_t(s.N), int64_t(s.K), s.a.batch, s.a.row, s.a.col,
                      s.b.batch, s.b.row, s.b.col, s.c.batch, s.c.row, s.c.col})
      h = h * 1000003u ^ size_t(v);
    uint32_t b;
    std::memcpy(&b, &s.beta, sizeof b);
    return h * 1000003u ^ b;
  }
};

memory::desc operand_desc(int batch, int rows, int cols, Strides st, memory::data_type t) {
  if (batch == 1) return memory::desc({rows, cols}, t, memory::dims{st.row, st.col});
  return memory::desc({batch, rows, cols}, t, memory::dims{st.batch, st.row, st.col});
}

dnnl::matmul::primitive_desc make_pd(const dnnl::engine& eng, const Shape& s) {
  dnnl::primitive_attr attr;
  if (s.beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(s.beta);
    attr.set_post_ops(po);
  }
  const dnnl::matmul::desc d(operand_desc(s.batch, s.M, s.K, s.a, memory::data_type::bf16),
                             operand_desc(s.batch, s.K, s.N, s.b, memory::data_type::bf16),
                             operand_desc(s.batch, s.M, s.N, s.c, memory::data_type::f32));
  return dnnl::matmul::primitive_desc(d, attr, eng);
}

// A primitive with its operands' memory objects, whose data handles each call sets.
struct Prim {
  dnnl::matmul mm;
  memory a, b, c;
};

struct Context {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};
  std::unordered_map<Shape, Prim, ShapeHash> prims;
  std::vector<bf16> abuf, bbuf;  // operands that came in fp32 form, rounded (exactly) to bf16
  // attention's scratch: probabilities, output gradient and score gradient as bf16
  std::vector<bf16> p, dout, ds;
  std::vector<float> dp;  // the probabilities' gradient, fp32
};

Context& context() {
  thread_local Context* c = [] {
    omp_set_num_threads(1);
    return new Context();  // lives as long as the thread; oneDNN objects outlive no engine
  }();
  return *c;
}

// The bf16 form of an operand stored as rows x cols with leading dimension ld: h in place, or f
// rounded into buf (dense, leading dimension cols).
const bf16* bf16_operand(Bf16Src s, int rows, int cols, int* ld, std::vector<bf16>& buf) {
  if (s.h) return s.h;
  buf.resize(size_t(rows) * cols);
  for (int r = 0; r < rows; ++r) round_to_bf16(buf.data() + size_t(r) * cols, s.f + size_t(r) * *ld, size_t(cols));
  *ld = cols;
  return buf.data();
}

// C = beta * C + A @ B over a batch, every operand bf16 but C (fp32).
void run(const Shape& s, const bf16* a, const bf16* b, float* c) {
  Context& ctx = context();
  try {
    auto it = ctx.prims.find(s);
    if (it == ctx.prims.end()) {
      const auto pd = make_pd(ctx.eng, s);
      it = ctx.prims
               .emplace(s, Prim{dnnl::matmul(pd), memory(pd.src_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                memory(pd.weights_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                memory(pd.dst_desc(), ctx.eng, DNNL_MEMORY_NONE)})
               .first;
    }
    Prim& p = it->second;
    // oneDNN's memory objects take a non-const pointer; the operands are only read.
    p.a.set_data_handle(const_cast<bf16*>(a));
    p.b.set_data_handle(const_cast<bf16*>(b));
    p.c.set_data_handle(c);
    p.mm.execute(ctx.stream, {{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}});
    ctx.stream.wait();
  } catch (const dnnl::error& e) {
    throw internal_error("oneDNN bf16 matmul ({} x {}x{}x{}): {}", s.batch, s.M, s.N, s.K, e.what());
  }
}

}  // namespace

std::string onednn_bf16_impl() {
  // The implementation oneDNN dispatches for a bf16 matmul of a typical shape here, or empty
  // when it has none for this CPU (oneDNN 2.x has no bf16 matmul below AVX-512).
  try {
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    omp_set_num_threads(1);
    return make_pd(eng, Shape{1, 256, 256, 256, {0, 256, 1}, {0, 256, 1}, {0, 256, 1}, 0.0f}).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                      float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n) C[size_t(m) * ldc + n] = beta == 0.0f ? 0.0f : beta * C[size_t(m) * ldc + n];
    return;
  }
  Context& ctx = context();
  const bf16* a = bf16_operand(A, ta ? K : M, ta ? M : K, &lda, ctx.abuf);
  const bf16* b = bf16_operand(B, tb ? N : K, tb ? K : N, &ldb, ctx.bbuf);
  const Strides sa = ta ? Strides{0, 1, lda} : Strides{0, lda, 1}, sb = tb ? Strides{0, 1, ldb} : Strides{0, ldb, 1};
  run(Shape{1, M, N, K, sa, sb, {0, ldc, 1}, beta}, a, b, C);
}

void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                      float beta, float* C, int ldc) {
  gemm_bf16_onednn(ta, tb, M, N, K, Bf16Src(A), lda, Bf16Src(B), ldb, beta, C, ldc);
}

// ---- Attention ----
//
// The four products of causal attention per sequence, batched over the heads: head h's q, k, v
// are columns [h hs, (h+1) hs) of the (T, 3C) rows, so a head is a batch stride of hs elements.
// Rows are taken in blocks of kAttBlock queries, which see keys [0, r1) only (as the fp32
// kernel, kernels.cc): the scores right of a block are never computed, read or written.

namespace {
constexpr int kAttBlock = 64;
}

void attention_forward_onednn(float* out, float* att, const bf16* qkv, int B, int T, int C, int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(float(hs));
  const int64_t C3 = 3 * int64_t(C), TT = int64_t(T) * T;
  Context& ctx = context();
  ctx.p.resize(size_t(NH) * kAttBlock * T);
  for (int b = 0; b < B; ++b) {
    const bf16* q = qkv + size_t(b) * T * C3;
    const bf16* k = q + C;
    const bf16* v = q + 2 * C;
    float* a = att + size_t(b) * NH * TT;
    for (int r0 = 0; r0 < T; r0 += kAttBlock) {
      const int r1 = std::min(T, r0 + kAttBlock), rows = r1 - r0;
      // scores (NH, rows, r1) = q k^T, unscaled, into att
      run(Shape{NH, rows, r1, hs, {hs, C3, 1}, {hs, 1, C3}, {TT, T, 1}, 0.0f}, q + r0 * C3, k, a + int64_t(r0) * T);
      for (int h = 0; h < NH; ++h)
        for (int t = r0; t < r1; ++t) {
          float* row = a + h * TT + int64_t(t) * T;
          bf16* pr = ctx.p.data() + (size_t(h) * kAttBlock + (t - r0)) * T;
          float mx = row[0];
          for (int u = 1; u <= t; ++u) mx = row[u] > mx ? row[u] : mx;
          float sum = 0.0f;
          for (int u = 0; u <= t; ++u) {
            row[u] = fast_exp((row[u] - mx) * scale);
            sum += row[u];
          }
          const float inv = 1.0f / sum;
          for (int u = 0; u <= t; ++u) {
            row[u] *= inv;
            pr[u] = to_bf16(row[u]);
          }
          for (int u = t + 1; u < r1; ++u) {
            row[u] = 0.0f;
            pr[u] = 0;
          }
        }
      // out rows (NH, rows, hs) = P v
      run(Shape{NH, rows, hs, r1, {int64_t(kAttBlock) * T, T, 1}, {hs, C3, 1}, {hs, C, 1}, 0.0f}, ctx.p.data(), v,
          out + (size_t(b) * T + r0) * C);
    }
  }
}

void attention_backward_onednn(float* dqkv, const float* dout, const bf16* qkv, const float* att, int B, int T, int C,
                               int NH) {
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(float(hs));
  const int64_t C3 = 3 * int64_t(C), TT = int64_t(T) * T;
  Context& ctx = context();
  ctx.p.resize(size_t(NH) * TT);
  ctx.ds.resize(size_t(NH) * TT);
  ctx.dp.resize(size_t(NH) * TT);
  ctx.dout.resize(size_t(T) * C);
  for (int b = 0; b < B; ++b) {
    const bf16* q = qkv + size_t(b) * T * C3;
    const bf16* k = q + C;
    const bf16* v = q + 2 * C;
    float* dq = dqkv + size_t(b) * T * C3;
    float* dk = dq + C;
    float* dv = dq + 2 * C;
    const float* a = att + size_t(b) * NH * TT;
    round_to_bf16(ctx.dout.data(), dout + size_t(b) * T * C, size_t(T) * C);
    const bf16* d = ctx.dout.data();
    for (int r0 = 0; r0 < T; r0 += kAttBlock) {
      const int r1 = std::min(T, r0 + kAttBlock), rows = r1 - r0;
      // dP (NH, rows, r1) = dout v^T; then through the softmax: dS = P (dP - rowsum(P dP)) scale
      run(Shape{NH, rows, r1, hs, {hs, C, 1}, {hs, 1, C3}, {TT, T, 1}, 0.0f}, d + int64_t(r0) * C, v,
          ctx.dp.data() + int64_t(r0) * T);
      for (int h = 0; h < NH; ++h)
        for (int t = r0; t < r1; ++t) {
          const int64_t at = h * TT + int64_t(t) * T;
          const float* ar = a + at;
          const float* dr = ctx.dp.data() + at;
          bf16* pr = ctx.p.data() + at;
          bf16* sr = ctx.ds.data() + at;
          float dot = 0.0f;
          for (int u = 0; u <= t; ++u) dot += ar[u] * dr[u];
          for (int u = 0; u <= t; ++u) {
            sr[u] = to_bf16(ar[u] * (dr[u] - dot) * scale);
            pr[u] = to_bf16(ar[u]);
          }
          for (int u = t + 1; u < r1; ++u) sr[u] = pr[u] = 0;
        }
      // dq rows (NH, rows, hs) = dS k
      run(Shape{NH, rows, hs, r1, {TT, T, 1}, {hs, C3, 1}, {hs, C3, 1}, 0.0f}, ctx.ds.data() + int64_t(r0) * T, k,
          dq + int64_t(r0) * C3);
    }
    // keys and values of block [c0, c1) are seen by query rows [c0, T) only: dv = P^T dout, dk = dS^T q
    for (int c0 = 0; c0 < T; c0 += kAttBlock) {
      const int c1 = std::min(T, c0 + kAttBlock), cols = c1 - c0, rows = T - c0;
      const int64_t corner = int64_t(c0) * T + c0;
      run(Shape{NH, cols, hs, rows, {TT, 1, T}, {hs, C, 1}, {hs, C3, 1}, 0.0f}, ctx.p.data() + corner,
          d + int64_t(c0) * C, dv + int64_t(c0) * C3);
      run(Shape{NH, cols, hs, rows, {TT, 1, T}, {hs, C3, 1}, {hs, C3, 1}, 0.0f}, ctx.ds.data() + corner,
          q + int64_t(c0) * C3, dk + int64_t(c0) * C3);
    }
  }
}

}  // namespace trn::kernels
