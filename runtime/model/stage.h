// A model's pieces run as a Stage: the blocks of one chunk of its ParamLayout, with the
// embedding in front on the first pipeline stage and the head behind on the last. One process is
// the stage that holds everything. Activations live in slots, one per micro-batch in flight, so
// a pipeline schedule can run forwards of several micro-batches before their backwards.
//
// What the pieces compute is the family's (family.h; runtime/model/gpt2.h, llama.h): each piece
// a forward and a backward over flat buffers (llm.c style), with Megatron's tensor-parallel split
// and its communication points (tp::Region) inside them. The Stage below is the same for every
// family: it owns the family's StageBody (stage_impl.h runs the slots). The bodies read weights
// and add gradients through views (views.h), by absolute buffer offsets.
//
// Templated on the element type: Stage<float> runs the fast kernels; Stage<double> the reference
// kernels in double precision, which the tests check against finite differences.
//
// Every family's bodies are written once, over a precision policy (below): how a matmul input is
// kept from forward for backward, which matmul multiplies, how an output gradient is rounded
// before its two products. FullPrecision<T> keeps everything in T (Stage<double> always runs
// it); Bf16Compute (Precision::kBf16, Stage<float> only): the linear layers and the LM head
// multiply bf16 operands with fp32 sums (runtime/kernels/bf16.h), their weights from a
// Bf16Weights copy of the fp32 parameters, their saved inputs stored as bf16, each output
// gradient rounded to bf16 before its products. Norms, activations, the residual stream, the
// softmax (attention and loss), biases and all gradients stay fp32 under every policy. Attention
// is blockwise under both (kernels.h attention_forward): a block keeps each row's log-sum-exp, not
// the probabilities; under Bf16Compute GPT-2's multiplies bf16 operands, Llama's runs the fp32
// kernel on the stored bf16 q, k and v. Since a body is shared, every
// policy finalises gradients (prefix_done) in the same order, which data-parallel overlap and
// ZeRO's buckets rely on. Another compute precision (fp8) is another policy with the same
// members.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "collectives/core/aligned.h"
#include "runtime/kernels/bf16.h"
#include "runtime/model/config.h"
#include "runtime/model/views.h"
#include "runtime/tensor_parallel/region.h"

namespace trn {
class ThreadPool;
namespace cp {
class Group;
}
}  // namespace trn

namespace trn::model {

// A matmul input saved by forward for backward, in the form the precision policy keeps it:
// `full` in the stage's type (FullPrecision) or `half` as bf16 (Bf16Compute); the other stays
// empty.
template <typename T>
struct SavedInput {
  std::vector<T> full;
  std::vector<kernels::bf16> half;
  size_t bytes() const { return full.size() * sizeof(T) + half.size() * sizeof(kernels::bf16); }
};

// The token rows of a micro-batch of B sequences of Tn tokens that one tensor-parallel rank
// holds between the tensor-parallel regions. Without sequence parallelism all N = B x Tn of them
// (local == N, first 0); with it (Config::sequence_parallel and tp > 1) the contiguous
// local = N / tp rows from first = tp_rank x local (a range that may start or end inside a
// sequence): the norms, residuals and dropout-free pointwise work between the regions treat each
// row alone, so which
// rows a rank holds changes no value, and a contiguous range makes the gather before a
// column-parallel block and the reduce-scatter after a row-parallel one in place, with no
// reordering (parallel::check requires tp to divide Tn, so N / tp is whole).
struct SeqRows {
  size_t N = 0, local = 0, first = 0;
  bool split = false;
  SeqRows(const ParamLayout& lay, int B, int Tn) : SeqRows(lay, size_t(B) * Tn) {}
  SeqRows(const ParamLayout& lay, size_t rows) : N(rows), local(rows) {
    const Placement& p = lay.placement();
    if (!lay.config().sequence_parallel || p.tp == 1) return;
    split = true;
    local = N / size_t(p.tp);
    first = local * size_t(p.tp_rank);
  }
};

// What a backward computes: everything, or (zero-bubble pipelines) first the input gradient with
// the norms', the head's and the embedding's gradients, and later the blocks' matmul weight
// gradients with their biases' (layers/linear.h).
enum class BackwardPart { kFull, kInput, kWeight };

// Scratch for backward, shared by every piece of a stage (one micro-batch at a time). A policy
// that keeps matmul inputs in another form (Bf16Compute) also computes them in dtmp and dbig in
// forward; under the emulated path its backward rounds output gradients in dtmp or dbig (or in
// place), and half holds one rounded to bf16 where no fp32 scratch is free (attn.c_proj when
// dbig is narrower than C, the weight pass of a split backward) and, under oneDNN, every one;
// qkv32 holds one sequence's q, k, v widened to fp32 (and, in Llama's backward, its attention
// output after them). Under sequence parallelism (SeqRows::split) seq holds N x C for the
// gathers and reduce-scatters (a row-parallel block's partial output, a gathered residual
// gradient) and dnorm a norm's weight gradient from this rank's rows, on its way to the tp sum.
template <typename T>
struct BackwardScratch {
  std::vector<T> dtmp, dbig, seq, dnorm;
  std::vector<kernels::bf16> half;
  std::vector<T> qkv32;
  // What a family's bodies need beyond these (sized by the family, stage_impl.h): scratch, and
  // constants computed once per stage (Llama's rotary cos and sin).
  std::vector<T> extra, tables;
  // The MoE layer's (layers/moe.h) buffers that outlive no layer but are reused by the next:
  // under full precision in fp32 its experts' rows padded to whole row buckets, and under expert
  // parallelism the rows its all_to_all_v exchanges send and receive. Kept here, sized by the
  // layer's scratch_buffers, so that the stage's count holds them.
  std::vector<T> pad[4], wire[4];
  // The running backward's loss_scale (d loss / d one token's loss), set by the stage: what a
  // layer that adds a loss of its own scales that loss's gradient by (the MoE layer's balancing
  // loss).
  T loss_scale = 0;
  // Context parallelism's group (the stage's region's, tp::Region::cp_group), through which the
  // policies' attention runs when set: not scratch, but what every policy is built with.
  cp::Group* cp = nullptr;
};

// The bf16 copy of a buffer's matmul weights (the tensors whose TensorSpec::matmul the family's
// spec set) that Precision::kBf16 multiplies with, at the fp32 buffer's offsets (other elements stay 0). It is
// a pure function of the fp32 master (round to nearest even), so rebuilding it after a load
// gives the copy an uninterrupted run had.
//
// Its form follows the bf16 kernel path at construction: for the emulated path the rounded
// weights are held widened in fp32 (4 bytes per parameter), which sgemm reads in place, so no
// matmul widens a weight, on any thread; for the oneDNN path as bf16 (2 bytes), what its
// kernels read. The two forms are the same operand (kernels::Bf16Src), so either path computes
// the same with either.
class Bf16Weights {
 public:
  explicit Bf16Weights(const ParamLayout& layout);
  // Rebuilds the copy from params; with a pool, every thread rounds a slice of each tensor.
  void refresh(const float* params, ThreadPool* pool = nullptr);
  kernels::Bf16Src data() const;
  // Frees the copy until the next refresh (ZeRO-3 holds no whole copy between steps).
  void release();

 private:
  void allocate();
  const ParamLayout& lay_;
  // 64-byte aligned like the fp32 buffer, so a gathered piece's bf16 form (SegmentStorage) puts
  // each element at the same address modulo 64 as this copy does.
  AlignedVector<kernels::bf16> h_;  // oneDNN path
  AlignedVector<float> f_;          // emulated path: bf16 values widened
};

// True when a Stage<T> of this layout runs Precision::kBf16 (float stages only).
template <typename T>
bool runs_bf16(const ParamLayout& lay) {
  return std::is_same_v<T, float> && lay.config().precision == Precision::kBf16;
}

// An output gradient on its way into a matmul's backward, and where a policy that rounds it
// before the two products may put the rounded copy: `into` is d itself when the caller is done
// with d after the matmul (spent), spare fp32 scratch of d's size, or null (the policy's own
// scratch). The bias gradient is always summed from the unrounded d.
template <typename T>
struct OutGrad {
  const T* d;
  T* into;
  static OutGrad spent(T* d) { return {d, d}; }
  static OutGrad kept(const T* d, T* spare = nullptr) { return {d, spare}; }
};

// How Bf16Compute's attention multiplies (a layer's choice, layers/attention.h): kBf16, the
// products on bf16 operands with fp32 sums, as PyTorch's autocast runs GPT-2's; kFp32, the fp32
// kernel over q, k, v (and output) rounded to bf16, as Llama's reference does. Full precision and
// context-parallel attention run the fp32 kernel either way.
enum class AttentionProducts { kBf16, kFp32 };

// The precision policies. Each has: Operand (what a matmul reads); a constructor from (the
// weights' view, scratch), the view outliving the policy; reserve(saved, n, fn), giving
// fn(vector, n) the vector of a SavedInput it keeps; reserve_scratch(scratch, wide, qkv, fn), the
// same for the scratch it needs beyond the common one (wide: N x the widest matmul output; qkv:
// one sequence's q, k, v); weight(offset), a matmul weight at its buffer offset, from the view in
// the form the policy multiplies; output(saved, scratch), where forward computes a matmul input;
// keep(saved, x, n), which stores it and returns the operand to multiply now; saved(saved), the
// operand backward multiplies; and the matmul, linear ([out, in] weights), LM head and attention
// kernels over Operands (shapes of runtime/kernels/kernels.h and llama.h).

// Everything in T: float runs the fast kernels, double the reference kernels.
template <typename T>
class FullPrecision {
 public:
  using Operand = const T*;
  FullPrecision(const WeightView<T>& w, BackwardScratch<T>& s) : w_(&w), cp_(s.cp) {}
  template <class Saved, class Fn>
  static void reserve(Saved& x, size_t n, Fn&& fn) {
    fn(x.full, n);
  }
  template <class Scratch, class Fn>
  static void reserve_scratch(Scratch&, size_t, size_t, Fn&&) {}
  Operand weight(size_t offset) const { return w_->f32(offset); }
  T* output(SavedInput<T>& x, T*) const { return x.full.data(); }  // computed where it is kept
  Operand keep(SavedInput<T>&, T* x, size_t) const { return x; }
  Operand saved(const SavedInput<T>& x) const { return x.full.data(); }
  void matmul_forward(T* out, Operand x, Operand w, const T* bias, int N, int IC, int OC) const;
  void matmul_backward(T* dx, T* dw, T* db, OutGrad<T> d, Operand x, Operand w, int N, int IC, int OC) const;
  void lmhead_forward(T* logits, Operand x, Operand wte, int N, int C, int V) const;
  void lmhead_backward(T* dx, T* dwte, OutGrad<T> dlogits, Operand x, Operand wte, int N, int C, int V) const;
  void linear_forward(T* out, Operand x, Operand w, int N, int IC, int OC) const;
  void linear_backward(T* dx, T* dw, OutGrad<T> d, Operand x, Operand w, int N, int IC, int OC) const;
  // Causal attention over q, k, v rows (B,T,(H+2K)hd), each KV head shared by H / K query heads
  // (multi-head: K = H); lse (B,H,T) (kernels.h attention_forward). The products choice is
  // Bf16Compute's; in full precision both are the same kernel.
  void attention_forward(T* out, T* lse, Operand qkv, int B, int Tn, int H, int K, int hd,
                         AttentionProducts products) const;
  void attention_backward(T* dqkv, const T* dout, Operand qkv, Operand out, const T* lse, int B, int Tn, int H,
                          int K, int hd, AttentionProducts products) const;

 private:
  const WeightView<T>* w_;
  cp::Group* cp_;  // context parallelism's attention (float stages only)
};

// Under context parallelism (BackwardScratch::cp) every policy's attention is the cp group's
// (runtime/context_parallel/attention.h) over fp32 operands: Bf16Compute widens its bf16 q, k, v and
// output, so GPT-2's bf16 attention then runs the fp32 kernel on bf16 values as Llama's does.
//
// Precision::kBf16 on a float stage: bf16 operands, fp32 sums. A matmul input is computed in
// fp32 scratch and rounded to bf16 into its saved copy; under the emulated path the same pass
// rounds the scratch through bf16 in place and both forms are handed on (the GEMM and attention
// read the fp32 one: nothing is widened in forward), under oneDNN only the bf16 copy is (Llama's
// grouped-query attention then widens q, k, v per sequence). An output gradient is rounded into
// the form the GEMM path reads: through bf16 in fp32 where OutGrad allows and the path is
// emulated, else into the bf16 scratch half.
class Bf16Compute {
 public:
  using Operand = kernels::Bf16Src;
  // w: its bf16 segments the Bf16Weights copy (none for the weight pass, which reads no weight).
  Bf16Compute(const WeightView<float>& w, BackwardScratch<float>& s) : w_(&w), s_(s) {}
  template <class Saved, class Fn>
  static void reserve(Saved& x, size_t n, Fn&& fn) {
    fn(x.half, n);
  }
  template <class Scratch, class Fn>
  static void reserve_scratch(Scratch& s, size_t wide, size_t qkv, Fn&& fn) {
    fn(s.half, wide);   // an output gradient rounded to bf16
    fn(s.qkv32, qkv);   // one sequence's q, k, v widened
  }
  Operand weight(size_t offset) const { return w_->bf16(offset); }
  float* output(SavedInput<float>&, float* scratch) const { return scratch; }
  Operand keep(SavedInput<float>& x, float* v, size_t n) const;
  Operand saved(const SavedInput<float>& x) const { return x.half.data(); }
  void matmul_forward(float* out, Operand x, Operand w, const float* bias, int N, int IC, int OC) const;
  void matmul_backward(float* dx, float* dw, float* db, OutGrad<float> d, Operand x, Operand w, int N, int IC,
                       int OC) const;
  void lmhead_forward(float* logits, Operand x, Operand wte, int N, int C, int V) const;
  void lmhead_backward(float* dx, float* dwte, OutGrad<float> dlogits, Operand x, Operand wte, int N, int C,
                       int V) const;
  // out (N,OC) = x (N,IC) w (OC,IC)^T; backward: dx = d w (unless null), dw += d^T x (unless null),
  // with d rounded as OutGrad allows.
  void linear_forward(float* out, Operand x, Operand w, int N, int IC, int OC) const;
  void linear_backward(float* dx, float* dw, OutGrad<float> d, Operand x, Operand w, int N, int IC, int OC) const;
  // Causal attention over q, k, v rows (B,T,(H+2K)hd) (multi-head: K = H). kBf16: the bf16 kernel
  // (bf16.h attention_forward_bf16); kFp32: the fp32 kernel on the bf16 values, each sequence
  // widened to fp32 (q, k, v, and in backward the saved output, in qkv32). Backward takes qkv and
  // out in their bf16 form (saved()).
  void attention_forward(float* out, float* lse, Operand qkv, int B, int Tn, int H, int K, int hd,
                         AttentionProducts products) const;
  void attention_backward(float* dqkv, const float* dout, Operand qkv, Operand out, const float* lse, int B, int Tn,
                          int H, int K, int hd, AttentionProducts products) const;

 private:
  const WeightView<float>* w_;
  BackwardScratch<float>& s_;
};

// Calls f(std::type_identity<P>{}) with the policy P a Stage<T> of this layout runs.
template <typename T, typename F>
decltype(auto) with_policy(const ParamLayout& lay, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (runs_bf16<T>(lay)) return f(std::type_identity<Bf16Compute>{});
  }
  return f(std::type_identity<FullPrecision<T>>{});
}

// What forwards of MoE blocks report, summed until taken: the balancing loss (summed over blocks
// and sequences) and, per global layer, each expert's kept choices and the choices the capacity
// dropped: loads[layer * (n_experts + 1) + e], e == n_experts for the dropped.
struct MoeCounts {
  double aux = 0;
  std::vector<double> loads;
  void add(const MoeCounts& o) {
    aux += o.aux;
    if (loads.size() < o.loads.size()) loads.resize(o.loads.size(), 0.0);
    for (size_t i = 0; i < o.loads.size(); ++i) loads[i] += o.loads[i];
  }
};

// What a family's stage runs (stage_impl.h implements it for each family's bodies); Stage
// below is its face. Arguments as Stage's view overloads.
template <typename T>
class StageBody {
 public:
  virtual ~StageBody() = default;
  virtual double forward(int slot, const WeightView<T>& w, const int32_t* inputs, const T* hidden,
                         const int32_t* targets) = 0;
  virtual void backward(int slot, const WeightView<T>& w, const GradView<T>& g, T loss_scale, const T* dout,
                        const std::function<void(size_t)>& prefix_done, BackwardPart part) = 0;
  virtual void backward_weights(int slot, const GradView<T>& g) = 0;
  virtual const T* output(int slot) const = 0;
  virtual const T* logits(int slot) const = 0;
  virtual const T* input_grad() const = 0;
  virtual size_t activation_bytes() const = 0;
  // What the last forward's MoE blocks reported (nothing without MoE).
  virtual const MoeCounts* moe_counts() const { return nullptr; }
};

template <typename T>
class Stage {
 public:
  // Chunk `chunk` of layout, with activations for `slots` micro-batches of `batch` sequences of
  // `seq_len` tokens, running the bodies of the layout's family.
  Stage(const ParamLayout& layout, int batch, int seq_len, int slots = 1, tp::Region* tp = nullptr, int chunk = 0);
  ~Stage();

  int batch() const { return B_; }
  int seq_len() const { return T_; }
  int slots() const { return slots_; }
  bool first() const { return chunk_.embedding; }
  bool last() const { return chunk_.head; }

  // The weights w give every tensor this stage reads at its layout offset: the master form,
  // and under Precision::kBf16 also the bf16 form of the matmul weights.
  // First stage: inputs are (B,T) token ids; otherwise hidden is the (B,T,C) input. Last stage:
  // returns the sum (not the mean) of the B*T token losses (targets null: logits only);
  // otherwise 0, and output(slot) holds the (B,T,C) result.
  double forward(int slot, const WeightView<T>& w, const int32_t* inputs, const T* hidden,
                 const int32_t* targets) {
    check_weights(w);
    const double loss = body_->forward(slot, w, inputs, hidden, targets);
    if (const MoeCounts* m = body_->moe_counts()) moe_.add(*m);
    return loss;
  }
  // Adds what the MoE blocks of the forwards since the last call reported into `into`, and
  // starts a new sum.
  void take_moe_counts(MoeCounts& into) {
    into.add(moe_);
    moe_ = {};
  }
  // Adds the gradient into g: on the last stage of loss_scale * sum of token losses, on the
  // others given dout, the gradient of output(slot). Needs slot's forward. After each group of
  // tensors is final, calls prefix_done(n) with the number of leading elements of the gradient
  // buffer that this backward will not touch again (a full backward only: after kInput the
  // weights are still to come). Afterwards input_grad() holds the gradient of the hidden input
  // (stages after the first).
  void backward(int slot, const WeightView<T>& w, const GradView<T>& g, T loss_scale, const T* dout,
                const std::function<void(size_t)>& prefix_done, BackwardPart part = BackwardPart::kFull) {
    check_weights(w);
    body_->backward(slot, w, g, loss_scale, dout, prefix_done, part);
  }
  // After backward(..., kInput) of slot: the blocks' matmul weight gradients (the W of
  // zero-bubble schedules). Adds into g in the order a full backward would.
  void backward_weights(int slot, const GradView<T>& g) { body_->backward_weights(slot, g); }

  // The same over whole buffers of layout().total() elements: params and grads, with the bf16
  // copy use_bf16_weights gave under Precision::kBf16.
  double forward(int slot, const T* params, const int32_t* inputs, const T* hidden, const int32_t* targets) {
    return forward(slot, whole_weights(params), inputs, hidden, targets);
  }
  void backward(int slot, const T* params, T* grads, T loss_scale, const T* dout,
                const std::function<void(size_t)>& prefix_done, BackwardPart part = BackwardPart::kFull) {
    backward(slot, whole_weights(params), GradView<T>::whole(grads, lay_.total()), loss_scale, dout,
             prefix_done, part);
  }
  void backward_weights(int slot, T* grads) {
    backward_weights(slot, GradView<T>::whole(grads, lay_.total()));
  }

  // Precision::kBf16: the bf16 weights the whole-buffer calls multiply with (a Bf16Weights of
  // the same layout, kept current by the owner). Must be set before such a forward.
  void use_bf16_weights(kernels::Bf16Src w) { pw_ = w; }

  const T* output(int slot) const { return body_->output(slot); }
  // Last stage, after slot's forward with targets null: the logits, (B*T, layout().local_vocab())
  // row-major, this rank's vocabulary rows from layout().vocab_begin() (padding rows past the
  // vocabulary included). A forward with targets turns them into probabilities in place. Null on
  // other stages.
  const T* logits(int slot) const { return body_->logits(slot); }
  const T* input_grad() const { return body_->input_grad(); }
  // The bytes of the activation slots and scratch this stage holds (not the parameters, nor the
  // output gradients a zero-bubble input pass keeps).
  size_t activation_bytes() const { return body_->activation_bytes(); }
  // What a Stage(layout, batch, seq_len, slots, tp, chunk) would hold, without allocating it: the
  // same list of buffers as the constructor, counted (the memory check before a run).
  static size_t activation_bytes(const ParamLayout& layout, int batch, int seq_len, int slots, int chunk = 0);

 private:
  WeightView<T> whole_weights(const T* params) const;  // params, and pw_ under kBf16 (checked)
  void check_weights(const WeightView<T>& w) const;    // a bf16 form under kBf16

  const ParamLayout& lay_;
  const Chunk chunk_;
  int B_, T_, slots_;
  std::unique_ptr<StageBody<T>> body_;
  kernels::Bf16Src pw_;
  MoeCounts moe_;
};

extern template class Stage<float>;
extern template class Stage<double>;

}  // namespace trn::model
