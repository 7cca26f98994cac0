#include "runtime/train/snapshot.h"

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <set>

#include "collectives/core/error.h"
#include "collectives/core/log.h"
#include "runtime/util/trace.h"

namespace trn::train {
namespace {

using log::Subsys;

int64_t host_hash() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return int64_t(std::hash<std::string>{}(name) & 0x7fffffffffffffffull);
}

bool holds(const int64_t (&steps)[2], int64_t s) { return steps[0] == s || steps[1] == s; }

// dst = src[0, n), with non-temporal stores where the CPU has them: a snapshot is not read again
// until a recovery, so its tens of megabytes should not evict the next step's weights and
// activations from the caches (bench/results/2026-12-02-recovery-in-place.md).
void stream_copy(std::vector<float>& dst, const float* src, size_t n) {
  dst.resize(n);
  float* d = dst.data();
  size_t i = 0;
#ifdef __AVX__
  while (i < n && (reinterpret_cast<uintptr_t>(d + i) & 31) != 0) {
    d[i] = src[i];
    ++i;
  }
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(src + i));
  _mm_sfence();
#endif
  if (i < n) std::memcpy(d + i, src + i, sizeof(float) * (n - i));
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int BuddyMap::ward(int r) const {
  for (size_t q = 0; q < holder.size(); ++q)
    if (holder[q] == r) return int(q);
  return -1;
}

BuddyMap buddy_map(const parallel::GridShape& shape, const std::vector<int64_t>& host_of, bool zero) {
  const int world = shape.world();
  BuddyMap b;
  b.holder.assign(size_t(world), -1);
  if (world == 1) return b;
  // The replicas (dp x cp ranks) hold the same weights and moments.
  const int reps = shape.replicas();
  if (reps > 1 && !zero) {
    b.mirrored = true;
    for (int r = 0; r < world; ++r) {
      const std::vector<int> group = shape.dp_group(r);
      const int d = shape.replica(shape.coords_of(r));
      for (int k = 1; k < reps && b.holder[r] < 0; ++k)
        if (const int q = group[size_t((d + k) % reps)]; host_of[q] != host_of[r]) b.holder[r] = q;
      if (b.holder[r] < 0) b.holder[r] = group[size_t((d + 1) % reps)];
    }
    return b;
  }
  // Hosts in order of their lowest rank, and each rank's position on its host.
  std::vector<int64_t> hosts;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < world; ++r) {
    auto it = std::find(hosts.begin(), hosts.end(), host_of[r]);
    if (it == hosts.end()) {
      hosts.push_back(host_of[r]);
      members.emplace_back();
      it = hosts.end() - 1;
    }
    members[size_t(it - hosts.begin())].push_back(r);
  }
  bool uniform = true;
  for (const auto& m : members) uniform = uniform && m.size() == members[0].size();
  if (hosts.size() == 1 || !uniform) {
    // One host (or uneven hosts, where a same-position map would not be one-to-one): the next rank.
    for (int r = 0; r < world; ++r) b.holder[r] = (r + 1) % world;
    return b;
  }
  for (size_t h = 0; h < members.size(); ++h)
    for (size_t i = 0; i < members[h].size(); ++i) b.holder[members[h][i]] = members[(h + 1) % members.size()][i];
  return b;
}

int64_t state_key(const parallel::GridShape& shape, int rank, bool zero) {
  // Under ZeRO the moments a rank holds are its slice of a partition over the replicas (dp x cp):
  // the same rank of a grid with another count holds another slice, so the count is part of the key (a changed dp finds no
  // snapshot and resumes from disk, which reshards).
  if (zero && shape.replicas() > 1) return (int64_t(1) << 60) + (int64_t(shape.replicas()) << 30) + rank;
  const parallel::Coords c = shape.coords_of(rank);
  return int64_t(c.pp) * shape.tp + c.tp;
}

RestorePlan plan_restore(const parallel::GridShape& shape, const BuddyMap& buddies, const std::vector<HeldSteps>& held,
                         bool zero) {
  int64_t bound = std::numeric_limits<int64_t>::max();
  for (const auto& h : held)
    if (h.bound >= 0) bound = std::min(bound, h.bound);
  std::set<int64_t, std::greater<>> candidates;
  for (const auto& h : held)
    for (int64_t s : h.own)
      if (s >= 0 && s <= bound) candidates.insert(s);
  RestorePlan plan;
  if (candidates.empty()) {
    plan.why_none = bound == std::numeric_limits<int64_t>::max()
                        ? "no rank holds a snapshot"
                        : fmt::format("no rank holds a snapshot of step {} or before (the metrics' last line)", bound);
    return plan;
  }
  const int world = int(held.size());
  for (int64_t step : candidates) {
    std::vector<RestorePlan::Transfer> transfers;
    int missing = -1;
    for (int r = 0; r < world && missing < 0; ++r) {
      const int64_t need = state_key(shape, r, zero);
      if (held[r].key == need && holds(held[r].own, step)) continue;
      int from = -1;
      bool from_copy = false;
      for (int q = 0; q < world && from < 0; ++q)
        if (q != r && held[q].key == need && holds(held[q].own, step)) from = q;
      if (from < 0 && !buddies.mirrored)
        if (const int h = buddies.holder[size_t(r)]; h >= 0 && holds(held[h].copy, step)) {
          from = h;
          from_copy = true;
        }
      if (from < 0) missing = r;
      else transfers.push_back({r, from, from_copy});
    }
    if (missing < 0) {
      plan.step = step;
      plan.transfers = std::move(transfers);
      return plan;
    }
    if (plan.why_none.empty())
      plan.why_none = fmt::format("rank {}'s state at step {} is in no rank's memory", missing, step);
  }
  return plan;
}

Snapshots::~Snapshots() { detach(); }

void Snapshots::attach(const parallel::ProcessGrid& grid, bool zero, const model::LocalModel& model,
                       const optim::Optimizer& optimizer) {
  detach();
  shape_ = grid.shape();
  zero_ = zero;
  rank_ = grid.rank();
  const auto& world = grid.world();
  if (!world) {
    buddies_ = buddy_map(shape_, {0}, zero);
    sizes_ = {{int64_t(model.param_storage_size()), int64_t(optimizer.m().size()), int64_t(optimizer.v().size())}};
    return;
  }
  const int n = world->size();
  const int64_t mine[4] = {host_hash(), int64_t(model.param_storage_size()), int64_t(optimizer.m().size()),
                           int64_t(optimizer.v().size())};
  std::vector<int64_t> all(size_t(4) * n);
  world->all_gather(mine, all.data(), 4, DataType::kI64)->wait();
  std::vector<int64_t> host_of(static_cast<size_t>(n));
  sizes_.assign(size_t(n), {});
  for (int r = 0; r < n; ++r) {
    host_of[r] = all[4 * r];
    sizes_[r] = {all[4 * r + 1], all[4 * r + 2], all[4 * r + 3]};
  }
  buddies_ = buddy_map(shape_, host_of, zero);
  comm_ = world->split(0, rank_);
  if (rank_ == 0)
    log::info(Subsys::kTrain, "in-memory snapshots every {} step{}: {}; rank 0's copy is held by rank {}", every_,
              every_ == 1 ? "" : "s",
              buddies_.mirrored ? "each rank's copy is a data-parallel replica's own snapshot (nothing is sent)"
                                : "each rank sends its snapshot to its buddy asynchronously",
              buddies_.holder[0]);
}

void Snapshots::detach() {
  // Transfers in flight: the generation's transport is aborted by then (or they complete now). A
  // copy whose every piece arrived counts, whatever became of this rank's own send.
  try {
    finish_transfer();
  } catch (const Error&) {
  }
  comm_.reset();
}

void Snapshots::post_send(const SnapshotState& s, int to) {
  header_out_[0] = s.step;
  header_out_[1] = s.optimizer_steps;
  pending_send_.push_back(comm_->send(header_out_, 2, DataType::kI64, to));
  for (const auto* part : {&s.params, &s.m, &s.v})
    if (!part->empty()) pending_send_.push_back(comm_->send(part->data(), part->size(), DataType::kF32, to));
  bytes_sent_ += sizeof header_out_ + sizeof(float) * (s.params.size() + s.m.size() + s.v.size());
}

void Snapshots::post_recv(SnapshotState& s, const Sizes& sizes, int from) {
  s.step = -1;
  s.params.resize(size_t(sizes.params));
  s.m.resize(size_t(sizes.m));
  s.v.resize(size_t(sizes.v));
  pending_recv_.push_back(comm_->recv(header_in_, 2, DataType::kI64, from));
  for (auto* part : {&s.params, &s.m, &s.v})
    if (!part->empty()) pending_recv_.push_back(comm_->recv(part->data(), part->size(), DataType::kF32, from));
}

void Snapshots::finish_transfer() {
  // Every handle is waited for (none may outlive the buffers it writes or reads); the first error
  // is thrown once all are done. The received copy counts only when all its pieces arrived.
  std::exception_ptr error;
  auto wait_all = [&](std::vector<WorkPtr>& handles) {
    bool ok = true;
    for (auto& w : handles) try {
        w->wait();
      } catch (...) {
        ok = false;
        if (!error) error = std::current_exception();
      }
    handles.clear();
    return ok;
  };
  const bool received = wait_all(pending_recv_);
  wait_all(pending_send_);
  if (pending_copy_ >= 0 && received) {
    copy_[pending_copy_].step = header_in_[0];
    copy_[pending_copy_].optimizer_steps = header_in_[1];
  }
  pending_copy_ = -1;
  if (error) std::rethrow_exception(error);
}

void Snapshots::take(int64_t step, const model::LocalModel& model, const optim::Optimizer& optimizer) {
  if (every_ <= 0 || step % every_ != 0) return;
  trace::Span span("snapshot", "checkpoint", {{"step", step}});
  const auto t0 = std::chrono::steady_clock::now();
  finish_transfer();
  SnapshotState& s = own_[own_[0].step <= own_[1].step ? 0 : 1];
  s.step = -1;
  stream_copy(s.params, model.params(), model.param_storage_size());
  stream_copy(s.m, optimizer.m().data(), optimizer.m().size());
  stream_copy(s.v, optimizer.v().data(), optimizer.v().size());
  s.optimizer_steps = optimizer.steps_taken();
  s.step = step;
  // Both own slots hold states of this grid: a recovery that changed it kept only one (restore()).
  own_key_ = state_key(shape_, rank_, zero_);
  own_world_ = shape_.world();
  ++taken_;
  if (comm_ && !buddies_.mirrored) {
    post_send(s, buddies_.holder[size_t(rank_)]);
    if (const int w = buddies_.ward(rank_); w >= 0) {
      pending_copy_ = copy_[0].step <= copy_[1].step ? 0 : 1;
      post_recv(copy_[pending_copy_], sizes_[size_t(w)], w);
    }
  }
  blocked_s_ += since(t0);
}

HeldSteps Snapshots::held() const {
  HeldSteps h;
  h.key = own_key_;
  for (int i = 0; i < 2; ++i) {
    h.own[i] = own_[i].step;
    // A copy is of the ward of the grid it was sent in.
    h.copy[i] = own_world_ == shape_.world() ? copy_[i].step : -1;
  }
  return h;
}

std::optional<int64_t> Snapshots::restore(model::LocalModel& model, optim::Optimizer& optimizer, int64_t bound) {
  if (!comm_) return std::nullopt;  // a world of one: nobody to hold or send anything
  const auto t0 = std::chrono::steady_clock::now();
  finish_transfer();
  HeldSteps mine = held();
  mine.bound = bound;
  const int n = comm_->size();
  std::vector<HeldSteps> table(static_cast<size_t>(n));
  static_assert(sizeof(HeldSteps) == 6 * sizeof(int64_t));
  comm_->all_gather(&mine, table.data(), 6, DataType::kI64)->wait();
  const RestorePlan plan = plan_restore(shape_, buddies_, table, zero_);
  if (plan.step < 0) {
    bool any = false;
    for (const auto& h : table) any = any || h.own[0] >= 0 || h.own[1] >= 0;
    if (rank_ == 0 && any)
      log::warn(Subsys::kTrain, "no in-memory snapshot covers every rank ({}): resuming as a restart does", plan.why_none);
    return std::nullopt;
  }
  const int64_t step = plan.step;
  auto own_slot = [&](int64_t s) -> SnapshotState* {
    for (auto& o : own_)
      if (o.step == s) return &o;
    return nullptr;
  };
  SnapshotState received;
  bool receives = false;
  for (const auto& t : plan.transfers) {
    if (t.from == rank_) {
      const SnapshotState* src = nullptr;
      if (t.from_copy) {
        for (auto& c : copy_)
          if (c.step == step) src = &c;
      } else {
        src = own_slot(step);
      }
      if (!src) throw internal_error("snapshot plan names rank {} to send step {}, which it does not hold", rank_, step);
      post_send(*src, t.to);
    }
    if (t.to == rank_) {
      receives = true;
      post_recv(received, sizes_[size_t(rank_)], t.from);
    }
  }
  finish_transfer();
  uint64_t got_bytes = 0;
  const SnapshotState* src = receives ? nullptr : own_slot(step);
  if (receives) {
    received.step = header_in_[0];
    received.optimizer_steps = header_in_[1];
    if (received.step != step)
      throw internal_error("received the snapshot of step {} where step {} was planned", received.step, step);
    got_bytes = sizeof(float) * (received.params.size() + received.m.size() + received.v.size());
    SnapshotState& slot = own_[own_[0].step <= own_[1].step ? 0 : 1];
    slot = std::move(received);
    src = &slot;
  }
  if (src->params.size() != model.param_storage_size() || src->m.size() != optimizer.m().size() ||
      src->v.size() != optimizer.v().size())
    throw internal_error("the snapshot of step {} does not fit this rank's model", step);
  std::memcpy(model.params(), src->params.data(), sizeof(float) * src->params.size());
  std::copy(src->m.begin(), src->m.end(), optimizer.mutable_m().begin());
  std::copy(src->v.begin(), src->v.end(), optimizer.mutable_v().begin());
  optimizer.set_steps_taken(src->optimizer_steps);
  // Snapshots of steps after the one everyone goes on from belong to an abandoned future, and
  // any but the loaded one may be of another grid's state: keep only the loaded one.
  for (auto& o : own_)
    if (&o != src) o.step = -1;
  for (auto& c : copy_)
    if (c.step != step || own_world_ != shape_.world()) c.step = -1;
  own_key_ = state_key(shape_, rank_, zero_);
  own_world_ = shape_.world();
  // Every holder keeps a copy of this step again before training goes on.
  if (!buddies_.mirrored) {
    post_send(*src, buddies_.holder[size_t(rank_)]);
    if (const int w = buddies_.ward(rank_); w >= 0) {
      pending_copy_ = copy_[0].step <= copy_[1].step ? 0 : 1;
      post_recv(copy_[pending_copy_], sizes_[size_t(w)], w);
    }
    finish_transfer();
  }
  int64_t moved = int64_t(got_bytes);
  comm_->all_reduce(&moved, &moved, 1, DataType::kI64, ReduceOp::kSum)->wait();
  if (rank_ == 0)
    log::info(Subsys::kTrain,
              "restored step {} from memory in {:.0f} ms: {} rank{} received {:.1f} MB from a buddy, the rest kept "
              "their own",
              step, 1e3 * since(t0), plan.transfers.size(), plan.transfers.size() == 1 ? "" : "s", moved / 1e6);
  return step;
}

}  // namespace trn::train
