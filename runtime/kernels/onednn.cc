// Matmuls through oneDNN's matmul primitive (Debian's libdnnl, 2.x API): bf16 x bf16 with fp32
// accumulation into an fp32 C (bf16.h), and fp32 x fp32 (kernels.h, on AVX-512 CPUs), transposed
// operands and leading dimensions expressed as strides, beta as a sum post-op, a bias as the
// primitive's bias argument. On CPUs with AVX512-BF16 oneDNN runs bf16 with its brgemm kernels
// (brg:avx512_core_bf16), fp32 with brg:avx512_core.
//
// Threads: the model runs one GEMM per compute thread, each with gemm_threads() threads of its
// own (kernels.h; 1 unless the compute threads leave some of --threads over). libdnnl is built on
// OpenMP, whose thread count is per calling thread: each thread sets it to gemm_threads() before
// its primitives are made, and makes them again if that changes (a primitive keeps the count it
// was made with).
//
// Primitives: creating one (descriptor, dispatch, JIT) costs microseconds even when oneDNN's own
// cache has it, so each thread keeps the primitives it made by shape. A model calls a few dozen
// shapes, and the same shapes every step; the MoE layer's experts, whose row counts change every
// step, up to one set per 32-row bucket (layers/moe.h).
//
// Scratchpads: each primitive's scratch (the brgemm kernels' accumulators, up to the size of C)
// is the user's, one buffer per thread grown to the largest any of its primitives needs, rather
// than oneDNN's, which left to itself holds one per primitive: at moe-small (the experts'
// backward products alone made 51 primitives of about 0.55 MB) that was 36 MiB of a process's
// peak RSS that no count could foresee, as it follows how many buckets the loads visit
// (bench/results/2026-12-07-moe-memory.md). Primitives run one at a time on their thread, so
// one buffer serves them all.
#include <omp.h>

#include <cstring>
#include <oneapi/dnnl/dnnl.hpp>
#include <unordered_map>
#include <vector>

#include "collectives/core/aligned.h"
#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/kernels/kernels.h"

namespace trn::kernels {
namespace {

using dnnl::memory;

using Strides = MatStrides;

// A matmul as oneDNN sees it: batch x (M,K) @ (K,N) -> (M,N), strides of A, B, C, and beta.
// batch 1 is a 2-D matmul (the batch strides unused).
struct Shape {
  int batch, M, N, K;
  Strides a, b, c;
  float beta;
  bool bias = false;  // an fp32 row of N added to every row of C (2-D only)
  bool f32 = false;   // A and B fp32 (else bf16)
  bool operator==(const Shape& o) const {
    auto same = [](Strides x, Strides y) { return x.batch == y.batch && x.row == y.row && x.col == y.col; };
    return batch == o.batch && M == o.M && N == o.N && K == o.K && same(a, o.a) && same(b, o.b) && same(c, o.c) &&
           std::memcmp(&beta, &o.beta, sizeof beta) == 0 && bias == o.bias && f32 == o.f32;
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
    return (h * 1000003u ^ b) * 4 + s.bias * 2 + s.f32;
  }
};

memory::desc operand_desc(int batch, int rows, int cols, Strides st, memory::data_type t) {
  if (batch == 1) return memory::desc({rows, cols}, t, memory::dims{st.row, st.col});
  return memory::desc({batch, rows, cols}, t, memory::dims{st.batch, st.row, st.col});
}

dnnl::matmul::primitive_desc make_pd(const dnnl::engine& eng, const Shape& s) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (s.beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(s.beta);
    attr.set_post_ops(po);
  }
  const auto in = s.f32 ? memory::data_type::f32 : memory::data_type::bf16;
  const auto a = operand_desc(s.batch, s.M, s.K, s.a, in), b = operand_desc(s.batch, s.K, s.N, s.b, in),
             c = operand_desc(s.batch, s.M, s.N, s.c, memory::data_type::f32);
  if (s.bias)
    return dnnl::matmul::primitive_desc(
        dnnl::matmul::desc(a, b, memory::desc({1, s.N}, memory::data_type::f32, memory::dims{s.N, 1}), c), attr, eng);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, eng);
}

// A primitive with its operands' memory objects, whose data handles each call sets.
struct Prim {
  dnnl::matmul mm;
  memory a, b, c, bias;
  memory scratch;  // over the thread's scratchpad (Context::scratch), when it needs one
  size_t scratch_bytes = 0;
};

struct Context {
  int threads = 0;  // the OpenMP thread count the primitives were made for
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};
  std::unordered_map<Shape, Prim, ShapeHash> prims;
  std::vector<bf16> abuf, bbuf;  // operands that came in fp32 form, rounded (exactly) to bf16
  // Every primitive's scratchpad, 64-byte aligned: as large as the largest one made.
  AlignedVector<uint8_t> scratch;
};

// Training needs about 50 primitives for the linear layers and 6 per 64-row block of a sequence for
// attention (about 150 at T = 1024), the same every step.
constexpr size_t kMaxPrims = 2048;

// The calling thread's context, freed with the thread (a trainer rebuilt after a recovery in
// place runs on new threads).
Context& context() {
  thread_local Context c;
  if (const int n = gemm_threads(); n != c.threads) {
    omp_set_num_threads(n);
    c.prims.clear();
    c.threads = n;
  }
  return c;
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

// C = beta * C + A @ B (+ bias) over a batch; A and B bf16 or (s.f32) fp32, C and bias fp32.
void run(const Shape& s, const void* a, const void* b, float* c, const float* bias = nullptr) {
  Context& ctx = context();
  try {
    auto it = ctx.prims.find(s);
    if (it == ctx.prims.end()) {
      // Training repeats a few dozen shapes; a caller whose shapes keep changing (prompts of
      // every length in trn-generate) starts over rather than growing without bound.
      if (ctx.prims.size() >= kMaxPrims) ctx.prims.clear();
      const auto pd = make_pd(ctx.eng, s);
      it = ctx.prims
               .emplace(s, Prim{dnnl::matmul(pd), memory(pd.src_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                memory(pd.weights_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                memory(pd.dst_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                s.bias ? memory(pd.bias_desc(), ctx.eng, DNNL_MEMORY_NONE) : memory(),
                                memory(pd.scratchpad_desc(), ctx.eng, DNNL_MEMORY_NONE),
                                pd.scratchpad_desc().get_size()})
               .first;
    }
    Prim& p = it->second;
    if (ctx.scratch.size() < p.scratch_bytes) ctx.scratch.resize(p.scratch_bytes);
    // oneDNN's memory objects take a non-const pointer; the operands are only read.
    p.a.set_data_handle(const_cast<void*>(a));
    p.b.set_data_handle(const_cast<void*>(b));
    p.c.set_data_handle(c);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, p.a}, {DNNL_ARG_WEIGHTS, p.b}, {DNNL_ARG_DST, p.c}};
    if (s.bias) {
      p.bias.set_data_handle(const_cast<float*>(bias));
      args.emplace(DNNL_ARG_BIAS, p.bias);
    }
    if (p.scratch_bytes > 0) {
      p.scratch.set_data_handle(ctx.scratch.data());
      args.emplace(DNNL_ARG_SCRATCHPAD, p.scratch);
    }
    p.mm.execute(ctx.stream, args);
    ctx.stream.wait();
  } catch (const dnnl::error& e) {
    throw internal_error("oneDNN {} matmul ({} x {}x{}x{}): {}", s.f32 ? "fp32" : "bf16", s.batch, s.M, s.N, s.K,
                         e.what());
  }
}

}  // namespace

std::string onednn_bf16_impl() {
  // The implementation oneDNN dispatches for a bf16 matmul of a typical shape here, or empty
  // when it has none for this CPU (oneDNN 2.x has no bf16 matmul below AVX-512).
  try {
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    return make_pd(eng, Shape{1, 256, 256, 256, {0, 256, 1}, {0, 256, 1}, {0, 256, 1}, 0.0f}).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

std::string onednn_f32_impl() {
  try {
    const dnnl::engine eng(dnnl::engine::kind::cpu, 0);
    Shape s{1, 256, 256, 256, {0, 256, 1}, {0, 256, 1}, {0, 256, 1}, 0.0f};
    s.f32 = true;
    return make_pd(eng, s).impl_info_str();
  } catch (const dnnl::error&) {
    return "";
  }
}

void gemm_f32_onednn(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                     float beta, float* C, int ldc, const float* bias) {
  if (M <= 0 || N <= 0) return;
  TRN_CHECK(K > 0 && (!bias || beta == 0.0f));
  Shape s{1, M, N, K, ta ? Strides{0, 1, lda} : Strides{0, lda, 1}, tb ? Strides{0, 1, ldb} : Strides{0, ldb, 1},
          {0, ldc, 1}, beta};
  s.f32 = true;
  s.bias = bias != nullptr;
  run(s, A, B, C, bias);
}

std::string onednn_version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, Bf16Src A, int lda, Bf16Src B, int ldb, float beta,
                      float* C, int ldc) {
  if (gemm_without_products(M, N, K, beta, C, ldc)) return;
  Context& ctx = context();
  const bf16* a = bf16_operand(A, ta ? K : M, ta ? M : K, &lda, ctx.abuf);
  const bf16* b = bf16_operand(B, tb ? N : K, tb ? K : N, &ldb, ctx.bbuf);
  const Strides sa = ta ? Strides{0, 1, lda} : Strides{0, lda, 1}, sb = tb ? Strides{0, 1, ldb} : Strides{0, ldb, 1};
  run(Shape{1, M, N, K, sa, sb, {0, ldc, 1}, beta}, a, b, C);
}

void matmul_forward_bf16_onednn(float* out, Bf16Src inp, Bf16Src w, const float* bias, int N, int IC, int OC) {
  if (N <= 0 || OC <= 0) return;
  if (IC <= 0) {  // no products: the bias rows, or zeros
    for (int n = 0; n < N; ++n)
      for (int o = 0; o < OC; ++o) out[size_t(n) * OC + o] = bias ? bias[o] : 0.0f;
    return;
  }
  Context& ctx = context();
  int lda = IC, ldb = OC;
  const bf16* a = bf16_operand(inp, N, IC, &lda, ctx.abuf);
  const bf16* b = bf16_operand(w, IC, OC, &ldb, ctx.bbuf);
  Shape s{1, N, OC, IC, {0, lda, 1}, {0, ldb, 1}, {0, OC, 1}, 0.0f};
  s.bias = bias != nullptr;
  run(s, a, b, out, bias);
}

void gemm_bf16_onednn(bool ta, bool tb, int M, int N, int K, const bf16* A, int lda, const bf16* B, int ldb,
                      float beta, float* C, int ldc) {
  gemm_bf16_onednn(ta, tb, M, N, K, Bf16Src(A), lda, Bf16Src(B), ldb, beta, C, ldc);
}

void batched_matmul_f32_onednn(int batch, int M, int N, int K, const float* A, MatStrides sa, const float* B,
                               MatStrides sb, float beta, float* C, MatStrides sc) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  TRN_CHECK(K > 0);
  Shape s{batch, M, N, K, sa, sb, sc, beta};
  s.f32 = true;
  run(s, A, B, C);
}

void batched_matmul_bf16_onednn(int batch, int M, int N, int K, const bf16* A, MatStrides sa, const bf16* B,
                                MatStrides sb, float beta, float* C, MatStrides sc) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  TRN_CHECK(K > 0);
  run(Shape{batch, M, N, K, sa, sb, sc, beta}, A, B, C);
}

}  // namespace trn::kernels
