// Fast float kernels: matmuls and attention through OpenBLAS cblas_sgemm or oneDNN, element-wise
// kernels with vectorizable loops. Each has a reference twin in ref.h (same arguments, plain
// loops) that the tests compare it with. The model runs several in parallel on disjoint slices
// of the batch; a matmul may use gemm_threads() threads of its own, the rest is single-threaded.
//
// The matmuls (the linear layers and the LM head) take oneDNN's fp32 matmul where the CPU has
// AVX-512 and oneDNN runs its brgemm kernels there (brg:avx512_core), for products of at least
// kOneDnnMinRows rows, and for the blockwise attention's block products (batched over the KV
// heads); OpenBLAS otherwise. Per shape, oneDNN measured 0.98-1.19x OpenBLAS on those matmuls
// (bench/results/2026-12-02-bf16-onednn.md) and 1.2-1.6x on attention's batched blocks
// (bench/results/2026-12-06-blockwise-attention.md). Either way a shape's result is the same from
// run to run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace trn::kernels {

constexpr int kOneDnnMinRows = 64;
// The threads one matmul may use, OpenBLAS's and oneDNN's alike (1 unless set): the model's
// compute threads split the batch, and what they leave of --threads goes to each matmul.
void set_gemm_threads(int n);
int gemm_threads();
// What runs the fp32 matmuls here, for the start-up line: "oneDNN 2.6.3 (brg:avx512_core)" or
// "OpenBLAS cblas_sgemm".
std::string fp32_matmul_description();
bool fp32_matmuls_onednn();
// The fp32 GEMM through oneDNN (tests call it directly): C = beta C + op(A) op(B) (+ bias, with
// beta 0). oneDNN's fp32 implementation here, or empty where it has none.
void gemm_f32_onednn(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb,
                     float beta, float* C, int ldc, const float* bias = nullptr);
std::string onednn_f32_impl();

// out (N,OC) = inp (N,IC) @ w (IC,OC) + bias (OC, may be null)
void matmul_forward(float* out, const float* inp, const float* w, const float* bias, int N, int IC,
                    int OC);
// dinp = dout @ w^T (overwritten); dw += inp^T @ dout; db += column sums of dout (db may be null).
// dinp null: the weight gradients only; dw null: the input gradient only (db skipped too).
void matmul_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                     const float* w, int N, int IC, int OC);

// out (N,OC) = inp (N,IC) @ w (OC,IC)^T: a linear layer whose weight is stored [out, in]
// (nn.Linear's layout, Llama's).
void linear_forward(float* out, const float* inp, const float* w, int N, int IC, int OC);
// dinp = dout @ w (overwritten) unless dinp is null; dw += dout^T @ inp unless dw is null.
void linear_backward(float* dinp, float* dw, const float* dout, const float* inp, const float* w, int N, int IC,
                     int OC);

// logits (N,V) = x (N,C) @ wte (V,C)^T
void lmhead_forward(float* logits, const float* x, const float* wte, int N, int C, int V);
// dx = dlogits @ wte (overwritten); dwte += dlogits^T @ x
void lmhead_backward(float* dx, float* dwte, const float* dlogits, const float* x,
                     const float* wte, int N, int C, int V);

// Causal attention, blockwise (attention.cc): grouped-query, scale 1/sqrt(hd). qkv
// (B,T,(H+2K)*hd) rows [q: H heads | k: K heads | v: K heads], query head h reading KV head
// h / (H/K) (K divides H; K == H with hd = C/H is GPT-2's (B,T,3C) layout). out (B,T,H*hd); lse
// (B,H,T) keeps each row's log-sum-exp of its scaled scores: the T x T probabilities are never
// stored, backward computes them again block by block. Reference twin: ref::attention_forward.
// Blocks of kAttentionRows query rows x kAttentionKeys keys (a multiple of it); the bf16 kernel's
// rounding of the forward's probabilities follows the key blocks (bf16.h).
constexpr int kAttentionRows = 128;
constexpr int kAttentionKeys = 128;
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int H, int K, int hd);
// The same attention for n query rows whose keys and values are held apart, as in a KV cache:
// row i of q is position t0 + i and attends to positions [0, t0 + i] of k and v. q (n, q_stride):
// a row's H heads of hd first; k, v (t0 + n, kv_stride): a position's K heads of hd first; out
// (n, out_stride): a row's H heads of hd first, overwritten; lse[h * lse_stride + i] as above
// unless lse is null. Blocks, order of operations and products are attention_forward's (which
// is this over each sequence's qkv rows with t0 = 0), except that a single row (n = 1, K < H)
// takes its group's H/K query heads as the rows of one product: no n x (t0 + n) scores are held,
// only one block per KV head. Reference twin: ref::attention_forward_rows.
void attention_forward_rows(float* out, int64_t out_stride, float* lse, int64_t lse_stride, const float* q,
                            int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int t0, int n, int H,
                            int K, int hd);
// One block of context-parallel attention (runtime/context_parallel): n query rows against nk
// keys and values held apart, with causal (n == nk, the same positions: row i sees keys [0, i])
// or every key visible (keys wholly before the queries). out (n, out_stride) and lse[h *
// lse_stride + i] are the block's own: its softmax over these keys only, which the caller merges
// with the other blocks' by their log-sum-exps. Blocks and products are attention_forward's.
void attention_block_forward(float* out, int64_t out_stride, float* lse, int64_t lse_stride, const float* q,
                             int64_t q_stride, const float* k, const float* v, int64_t kv_stride, int n, int nk,
                             bool causal, int H, int K, int hd);
// Its backward, given the whole attention's log-sum-exps and row terms D = dout . out (H rows of
// row_stride): dq (n, dq_stride), dk and dv (nk, dkv_stride) are added to.
void attention_block_backward(float* dq, int64_t dq_stride, float* dk, float* dv, int64_t dkv_stride,
                              const float* dout, int64_t dout_stride, const float* D, const float* lse,
                              int64_t row_stride, const float* q, int64_t q_stride, const float* k, const float* v,
                              int64_t kv_stride, int n, int nk, bool causal, int H, int K, int hd);
// Tests and trn-attention-bench: the fp32 attention's products through cblas_sgemm even where
// oneDNN would take them, as on a CPU without AVX-512 (process-wide; off by default).
void set_attention_blas(bool on);
// dqkv (B,T,(H+2K)*hd) overwritten (dk, dv summed over their group's query heads) from dout
// (B,T,H*hd) and the forward's qkv, out and lse.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int H, int K, int hd);

// tanh-approximated GELU over N values, and its backward (dinp overwritten).
void gelu_forward(float* out, const float* inp, size_t N);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t N);

// Softmax cross-entropy: logits (N,V) become probabilities in place, losses (N) = -log p[target].
void crossentropy_forward(float* losses, float* probs, const int32_t* targets, int N, int V);

}  // namespace trn::kernels
