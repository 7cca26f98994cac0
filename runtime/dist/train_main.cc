#include "runtime/dist/train_main.h"

#include <cstring>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include <algorithm>
#include <chrono>

#include "runtime/model/config.h"
#include "runtime/train/dp_sync.h"
#include "runtime/dist/world.h"
#include "runtime/train/trainer.h"

namespace trn::dist {
namespace {

using log::Subsys;

// FNV-1a over the parameter bytes: equal on every rank when the weights are bit-identical.
uint64_t fingerprint(const float* p, size_t n) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n * sizeof(float); ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

void check_weights_identical(Communicator& comm, const float* params, size_t n) {
  const uint64_t mine = fingerprint(params, n);
  std::vector<uint64_t> all(comm.size());
  comm.all_gather(&mine, all.data(), 1, DataType::kI64)->wait();
  for (int r = 0; r < comm.size(); ++r)
    if (all[r] != all[0])
      throw internal_error("data-parallel ranks diverged: rank 0 weights {:016x}, rank {} weights {:016x}",
                           all[0], r, all[r]);
  log::info(Subsys::kTrain, "final weights identical on all {} ranks (fingerprint {:016x})", comm.size(),
            all[0]);
}

// Seconds one blocking all-reduce of n gradients takes here (median of 5): the communication
// the overlap has to hide.
double measure_allreduce_s(Communicator& comm, size_t n) {
  std::vector<float> buf(n, 1.0f);
  std::vector<double> times;
  for (int i = 0; i < 5; ++i) {
    comm.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    comm.all_reduce(buf.data(), buf.data(), n, DataType::kF32, ReduceOp::kAvg)->wait();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int train_main(const train::Options& opt) {
  const int layout = opt.dp * opt.tp * opt.pp;
  auto world = World::from_environment();
  if (world->size() != layout)
    throw usage_error("--dp {} --tp {} --pp {} needs {} workers but the job has {}; launch with "
                      "trnrun --nproc-per-node {} (or mpirun -np {}), or change the layout",
                      opt.dp, opt.tp, opt.pp, layout, world->size(), layout, layout);

  std::unique_ptr<train::DataParallelSync> sync;
  if (world->comm()) {
    train::DataParallelOptions dpo;
    dpo.bucket_bytes = size_t(opt.bucket_mb * 1024 * 1024);
    dpo.bf16 = opt.grad_comm == "bf16";
    sync = std::make_unique<train::DataParallelSync>(world->comm(), model::ParamLayout(opt.model).total(), dpo);
  }
  try {
    train::Trainer trainer(opt, sync.get());
    trainer.on_step = [&](const train::StepStats& s) { world->report_progress(s.step, s.loss, s.tokens_per_s); };
    trainer.run();
    if (sync) {
      const auto& m = trainer.model();
      check_weights_identical(*world->comm(), m.params(), m.num_params());
      const double comm_s = measure_allreduce_s(*world->comm(), m.num_params());
      const auto& st = sync->stats();
      const double waited = st.steps ? st.exposed_s / double(st.steps) : 0.0;
      const double hidden = st.reduced ? double(st.reduced_in_backward) / double(st.reduced) : 0.0;
      if (world->rank() == 0)
        log::info(Subsys::kTrain,
                  "data parallel: {} ranks, {} buckets of {} MiB ({}); {:.0f}% of gradients were all-reduced "
                  "before backward ended; after backward the step waited {:.2f} ms for the rest and for "
                  "slower ranks (one blocking all-reduce of all gradients: {:.2f} ms)",
                  world->size(), sync->num_buckets(), opt.bucket_mb, opt.grad_comm, hidden * 100, waited * 1e3,
                  comm_s * 1e3);
    }
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUsage) world->report_failure(e.what());
    throw;
  }
  return 0;
}

}  // namespace trn::dist
