// What the trainer asks of an optimizer, whatever holds its state: AdamW over the whole buffer
// (adamw.h), or ZeRO-1's AdamW over this rank's slices of it (train::ZeroAdamW), which gathers
// the other ranks' updated slices after each step. A step is
//
//   norm = grad_norm(grads, pool);              // global, over every rank holding the model
//   update(params, grads, norm, lr, pool);      // clip to the norm, then AdamW
//   if (clears_grads()) the gradients are all 0 now
//
// and a checkpoint saves, for the elements whose state this rank keeps (shard()), their
// parameters beside AdamW's two moments, and restores them the same way (runtime/checkpoint).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/optim/zero.h"
#include "runtime/util/thread_pool.h"

namespace trn::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // The global gradient norm (before clipping) of the step's synced gradients, every global
  // element counted once: collective over the ranks that hold the rest of the model.
  virtual double grad_norm(const float* grads, ThreadPool& pool) = 0;
  // Clips the gradients this rank updates to the configured maximum norm given grad_norm, then
  // one AdamW update with learning rate lr; afterwards params holds the whole updated buffer
  // (AdamW with compact parameters, adamw.h Storage: the updated owned shard).
  virtual void update(float* params, float* grads, double grad_norm, float lr, ThreadPool& pool) = 0;
  // True when update() leaves every element of grads at 0, as zero_grad would, having read each
  // one (AdamW over a whole buffer): the trainer then tells the model, whose next zero_grad has
  // nothing to write. The default: update leaves grads to the caller.
  virtual bool clears_grads() const { return false; }

  // The ranges of the buffer whose parameters and state this rank keeps (ascending, disjoint;
  // ZeRO-1's owned slices); null: the whole buffer.
  virtual const std::vector<Range>* shard() const = 0;
  // AdamW's moments of the kept elements, one range after another (m()[0] is the first kept
  // element), and the number of updates taken: what a checkpoint saves and restores.
  virtual const std::vector<float>& m() const = 0;
  virtual const std::vector<float>& v() const = 0;
  virtual std::vector<float>& mutable_m() = 0;
  virtual std::vector<float>& mutable_v() = 0;
  virtual int64_t steps_taken() const = 0;
  virtual void set_steps_taken(int64_t t) = 0;
  virtual size_t state_bytes() const = 0;
  // The state this rank holds, for the log ("AdamW m and v of N of its M parameters; ...").
  virtual std::string describe() const = 0;

  // The kept elements of params, in shard() order (the parameters a checkpoint saves).
  std::vector<float> kept_params(const float* params, size_t n) const;
};

}  // namespace trn::optim
