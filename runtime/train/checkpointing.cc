#include "runtime/train/checkpointing.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "collectives/communicator.h"
#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "runtime/io/atomic_file.h"
#include "runtime/util/trace.h"

namespace trn::train {
namespace {

using log::Subsys;

// Rank 0's s on every rank of comm (null: alone).
void share(const std::shared_ptr<Communicator>& comm, std::string& s) {
  if (!comm) return;
  int64_t n = int64_t(s.size());
  comm->broadcast(&n, 1, DataType::kI64, 0)->wait();
  s.resize(size_t(n));
  if (n > 0) comm->broadcast(s.data(), s.size(), DataType::kU8, 0)->wait();
}

// Runs fn on rank 0 only (a decision about shared files) and throws whatever it threw, with its
// kind, on every rank of comm, so no rank waits in a later collective for one that left.
void on_rank0(const std::shared_ptr<Communicator>& comm, bool rank0, const std::function<void()>& fn) {
  std::string error;
  int64_t kind = -1;
  if (rank0) {
    try {
      fn();
    } catch (const Error& e) {
      error = e.what();
      kind = int64_t(e.kind());
    } catch (const std::exception& e) {
      error = e.what();
      kind = int64_t(ErrorKind::kInternal);
    }
  }
  if (comm) comm->broadcast(&kind, 1, DataType::kI64, 0)->wait();
  share(comm, error);
  if (kind >= 0) throw Error(ErrorKind(kind), error);
}

std::string random_run_id() {
  uint64_t x = 0;
  if (std::FILE* f = std::fopen("/dev/urandom", "rb")) {
    if (std::fread(&x, sizeof x, 1, f) != 1) x = 0;
    std::fclose(f);
  }
  if (x == 0)
    x = uint64_t(std::chrono::system_clock::now().time_since_epoch().count()) ^ (uint64_t(getpid()) << 32);
  return fmt::format("{:016x}", x);
}

// The settings a resume must match (checkpoint::State::settings), as this run has them.
std::vector<std::pair<std::string, std::string>> resume_settings(const Options& o) {
  return {{"--batch-size", fmt::format("{}", o.batch_size)},
          {"--seq-len", fmt::format("{}", o.seq_len)},
          {"--steps", fmt::format("{}", o.steps)},
          {"--lr", fmt::format("{}", o.lr)},
          {"--lr-schedule", o.schedule == optim::Schedule::Kind::kConstant ? "constant" : "cosine"},
          {"--warmup-steps", fmt::format("{}", o.warmup_steps)},
          {"--min-lr", o.min_lr < 0 ? std::string("lr/10") : fmt::format("{}", o.min_lr)},
          {"--weight-decay", fmt::format("{}", o.weight_decay)},
          {"--beta1", fmt::format("{}", o.beta1)},
          {"--beta2", fmt::format("{}", o.beta2)},
          {"--grad-clip", fmt::format("{}", o.grad_clip)},
          {"--seed", fmt::format("{}", o.seed)}};
}

}  // namespace

Checkpointer::Checkpointer(const Options& opt, const parallel::ProcessGrid* grid)
    : opt_(opt), grid_(grid), rank0_(!grid || grid->rank() == 0) {
  if (opt_.checkpoint_dir.empty()) return;
  io::make_writable_dir("--checkpoint-dir", opt_.checkpoint_dir);
  const auto& world = grid_ ? grid_->world() : nullptr;
  on_rank0(world, rank0_, [&] {
    const char* env = std::getenv("TRN_RUN_ID");
    run_id_ = env && *env ? env : random_run_id();
    dir_lock_ = std::make_unique<checkpoint::DirLock>(opt_.checkpoint_dir, run_id_);
  });
  share(world, run_id_);
}

Checkpointer::~Checkpointer() {
  if (saver_.joinable() && !save_done_.load() && comm_) comm_->abort("the trainer is stopping on an error");
  if (saver_.joinable()) saver_.join();
}

int64_t Checkpointer::resume(model::LocalModel& model, optim::Optimizer& optimizer) {
  const int64_t step = load_chosen(model, optimizer);
  if (!opt_.checkpoint_dir.empty() && grid_ && grid_->world()) comm_ = grid_->world()->split(0, grid_->rank());
  return step;
}

int64_t Checkpointer::resumed_at(int64_t step) {
  if (!opt_.checkpoint_dir.empty() && grid_ && grid_->world()) comm_ = grid_->world()->split(0, grid_->rank());
  return step;
}

int64_t Checkpointer::load_chosen(model::LocalModel& model, optim::Optimizer& optimizer) {
  // A worker that trnrun restarted (a generation after the first) resumes the newest checkpoint
  // of its own run; without one it does what the first generation did, except that it never
  // refuses (--resume never: a fresh start). Rank 0 chooses and every rank loads its choice, so
  // the ranks agree even while the directory changes under them.
  const bool restarted = opt_.generation > 0;
  const std::string& dir = opt_.checkpoint_dir;
  std::string path;
  const auto& world = grid_ ? grid_->world() : nullptr;
  on_rank0(world, rank0_, [&] {
    if (restarted && !dir.empty()) path = checkpoint::latest(dir, &run_id_).value_or("");
    if (!path.empty()) {
    } else if (opt_.resume == "never") {
      // A first start never writes beside another run's checkpoints: its saves would prune them
      // and a later --resume auto would mix the two runs. Nothing is moved or deleted.
      if (!restarted && !dir.empty())
        if (const auto other = checkpoint::newest_committed(dir))
          throw usage_error("--resume never, but --checkpoint-dir {} already holds committed checkpoints (the newest: "
                            "{}); use --resume auto to continue it, or an empty directory",
                            dir, *other);
    } else if (opt_.resume == "auto") {
      if (!dir.empty()) path = checkpoint::latest(dir).value_or("");
    } else {
      checkpoint::verify(opt_.resume);  // a bad explicit checkpoint is an error, not a fallback
      path = opt_.resume;
    }
  });
  share(world, path);
  if (path.empty()) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  const checkpoint::State st =
      checkpoint::load(path, model.layout(), model.params(), optimizer.mutable_m().data(),
                       optimizer.mutable_v().data(), optimizer.shard(), model.param_storage());
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Settings that change what the resumed steps compute (batch, data, schedule, optimizer) must
  // match the checkpoint's unless the run says it means it.
  const auto mine = resume_settings(opt_);
  std::vector<std::string> was, now;
  for (const auto& [flag, value] : st.settings)
    for (const auto& [f, v] : mine)
      if (f == flag && v != value) {
        was.push_back(flag + " " + value);
        now.push_back(f + " " + v);
      }
  auto join = [](const std::vector<std::string>& parts) {
    std::string out;
    for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : i + 1 == parts.size() ? " and " : ", ") + parts[i];
    return out;
  };
  if (!was.empty() && !opt_.allow_changed_settings)
    throw usage_error("checkpoint {} was saved with {}, this run has {}: pass the checkpoint's values to continue it, "
                      "or --allow-changed-settings to resume with this run's",
                      path, join(was), join(now));
  if (rank0_)
    for (size_t i = 0; i < was.size(); ++i)
      log::warn(Subsys::kTrain, "resuming {} with {} (it was saved with {}): --allow-changed-settings", path, now[i],
                was[i]);
  if (st.step > opt_.steps && !opt_.allow_changed_settings)
    throw usage_error("checkpoint {} is at step {}, past --steps {}: raise --steps or resume an earlier checkpoint", path,
                      st.step, opt_.steps);
  optimizer.set_steps_taken(st.optimizer_step);
  if (!rank0_) return st.step;
  if (st.step >= opt_.steps)
    log::info(Subsys::kTrain, "checkpoint {} is at step {} of --steps {}: training is already complete, nothing to do",
              path, st.step, opt_.steps);
  else
    log::info(Subsys::kTrain, "resumed from {} at step {} (loaded in {:.0f} ms)", path, st.step, load_s * 1e3);
  return st.step;
}

double Checkpointer::save(int64_t step, const model::LocalModel& model, const optim::Optimizer& optimizer,
                          const checkpoint::ReportFn& report) {
  trace::Span span("checkpoint (blocking part)", "checkpoint", {{"step", step}});
  const auto t0 = std::chrono::steady_clock::now();
  wait();
  // The snapshot: what the background writer saves while training goes on (under ZeRO-1 the
  // parameters this rank owns, beside their moments).
  snap_p_ = model.param_storage() == optim::Storage::kCompact
                ? std::vector<float>(model.params(), model.params() + model.param_storage_size())  // ZeRO-3's shard
                : optimizer.kept_params(model.params(), model.num_params());
  snap_m_ = optimizer.m();
  snap_v_ = optimizer.v();
  const checkpoint::State st{step, optimizer.steps_taken(), opt_.seed, run_id_, resume_settings(opt_)};
  const parallel::Plan lo = opt_.plan;
  const parallel::Coords me = grid_ ? grid_->coords() : parallel::Coords{};
  save_done_ = false;
  const model::ParamLayout* layout = &model.layout();
  const checkpoint::Owned* owned = optimizer.shard();
  saver_ = std::thread([this, st, lo, me, layout, owned, report] {
    try {
      trace::Span write("checkpoint (background write)", "checkpoint", {{"step", st.step}});
      const auto w0 = std::chrono::steady_clock::now();
      const std::string dir = checkpoint::save(opt_.checkpoint_dir, st, lo, *layout, snap_p_.data(), snap_m_.data(),
                                               snap_v_.data(), me, comm_, opt_.keep_checkpoints, report, owned);
      committed_step_ = st.step;
      committed_dir_ = dir;
      if (rank0_)
        log::info(Subsys::kTrain, "checkpoint of step {} committed to {} ({:.0f} ms in the background)", st.step, dir,
                  1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
    } catch (...) {
      save_error_ = std::current_exception();
    }
    save_done_.store(true, std::memory_order_release);
  });
  const double blocked = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank0_) log::info(Subsys::kTrain, "step {} blocked {:.1f} ms for its checkpoint", step, blocked * 1e3);
  return blocked;
}

void Checkpointer::check(bool wait) {
  if (!saver_.joinable()) return;  // alike on every rank: all start and join their saves together
  const std::shared_ptr<Communicator> world = grid_ ? grid_->world() : nullptr;
  const int size = world ? world->size() : 1, rank = world ? world->rank() : 0;
  auto nap = std::chrono::milliseconds(1);
  for (;;) {
    // {the lowest rank whose save failed, as size - rank (0: none), whether any save still runs}
    const bool done = save_done_.load(std::memory_order_acquire);
    const bool failed = done && save_error_;
    int32_t agreed[2] = {failed ? size - rank : 0, done ? 0 : 1};
    if (world) world->all_reduce(agreed, agreed, 2, DataType::kI32, ReduceOp::kMax)->wait();
    if (agreed[0] == 0 && agreed[1] == 0) {
      saver_.join();
      return;
    }
    if (agreed[0] != 0) {
      const int root = size - agreed[0];
      // The failing rank's error goes to every rank, so each stops with the save's own message.
      char msg[1024] = {};
      int32_t kind = static_cast<int32_t>(ErrorKind::kInternal);
      if (rank == root) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(save_error_);
        } catch (const Error& e) {
          what = e.what();
          kind = static_cast<int32_t>(e.kind());
        } catch (const std::exception& e) {
          what = e.what();
        }
        std::memcpy(msg, what.data(), std::min(what.size(), sizeof msg - 1));
      }
      if (world) {
        world->broadcast(msg, sizeof msg, DataType::kU8, root)->wait();
        world->broadcast(&kind, 1, DataType::kI32, root)->wait();
        // Once every rank has the message, the saves still blocked on the failed rank are
        // aborted; a peer's abort may fail this barrier, which changes nothing now.
        try {
          world->barrier()->wait();
        } catch (const Error&) {
        }
        if (!save_done_.load() && comm_) comm_->abort("a checkpoint save failed on another rank");
      }
      saver_.join();
      if (failed) std::rethrow_exception(std::exchange(save_error_, nullptr));
      save_error_ = nullptr;
      throw Error(static_cast<ErrorKind>(kind), fmt::format("{} (the checkpoint save on rank {})", msg, root));
    }
    if (!wait) return;
    std::this_thread::sleep_for(nap);
    nap = std::min(2 * nap, std::chrono::milliseconds(20));
  }
}

}  // namespace trn::train
