#include "collectives/communicator.h"

#include <sched.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "collectives/algorithms/algorithm.h"
#include "collectives/calibrate.h"
#include "collectives/check.h"
#include "collectives/core/log.h"
#include "collectives/core/settings.h"
#include "collectives/engine.h"
#include "collectives/tag.h"

namespace trn {

struct Communicator::Desc : CallDesc {};

namespace {

Algo algo_from_environment() {
  try {
    return parse_algo(settings::get("TRN_ALGO"));
  } catch (const Error& e) {
    throw e.with_context("TRN_ALGO=" + settings::get("TRN_ALGO"));
  }
}

A2aAlgo a2a_algo_from_environment() {
  try {
    return parse_a2a_algo(settings::get("TRN_A2A_ALGO"));
  } catch (const Error& e) {
    throw e.with_context("TRN_A2A_ALGO=" + settings::get("TRN_A2A_ALGO"));
  }
}

// elements * size, or a usage error naming what overflowed.
size_t bytes_of(size_t elements, size_t es, const char* what, int peer) {
  size_t b;
  if (__builtin_mul_overflow(elements, es, &b))
    throw usage_error("all_to_all_v: {}[{}] = {} elements is more bytes than memory holds", what, peer, elements);
  return b;
}

// Byte sizes and offsets of one side of an all_to_all_v, checked: n entries each, displacements
// packed when absent, no region past the end of memory.
void side_of(std::span<const size_t> counts, std::span<const size_t> displs, size_t es, int n, const char* counts_name,
             const char* displs_name, std::vector<size_t>& bytes, std::vector<size_t>& off) {
  if (counts.size() != static_cast<size_t>(n))
    throw usage_error("all_to_all_v: {} has {} entries but the communicator has {} ranks", counts_name,
                      counts.size(), n);
  if (!displs.empty() && displs.size() != static_cast<size_t>(n))
    throw usage_error("all_to_all_v: {} has {} entries but the communicator has {} ranks (or pass none: packed)",
                      displs_name, displs.size(), n);
  bytes.resize(n);
  off.resize(n);
  size_t packed = 0;
  for (int i = 0; i < n; ++i) {
    bytes[i] = bytes_of(counts[i], es, counts_name, i);
    off[i] = displs.empty() ? packed : bytes_of(displs[i], es, displs_name, i);
    size_t end;
    if (__builtin_add_overflow(off[i], bytes[i], &end))
      throw usage_error("all_to_all_v: {}[{}] + {}[{}] is past the end of memory", displs_name, i, counts_name, i);
    packed = end;
  }
}

}  // namespace

// ---- Work ----

bool Work::test() {
  if (!s_->done.load(std::memory_order_acquire)) {
    if (auto engine = engine_.lock()) engine->kick();  // it may wait unannounced (kBlockingStreak)
    return false;
  }
  std::lock_guard lock(s_->mu);
  if (s_->error) throw *s_->error;
  return true;
}

void Work::wait(Deadline deadline) {
  // A collective next in line on an idle engine runs right here (Engine::run_inline). Otherwise
  // poll first, yielding the core (TRN_COLL_POLL_US): a short operation finishes within it, and
  // the engine thread then needs no futex wake-up to hand it back.
  if (!s_->done.load(std::memory_order_acquire)) {
    if (auto engine = engine_.lock()) engine->run_inline(s_.get());
  }
  if (!s_->done.load(std::memory_order_acquire)) {
    const auto end = std::min(Clock::now() + coll_poll_window(), deadline.when());
    while (!s_->done.load(std::memory_order_acquire) && Clock::now() < end) sched_yield();
  }
  std::unique_lock lock(s_->mu);
  if (!s_->cv.wait_until(lock, deadline.when(), [&] { return s_->done.load(std::memory_order_relaxed); }))
    throw timeout_error("timed out after waiting for {} (it is still queued or running)", s_->what());
  if (s_->error) throw *s_->error;
}

const std::string& Work::what() const { return s_->what(); }

std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point> Work::ran() const {
  std::lock_guard lock(s_->mu);
  return {s_->started, s_->finished};
}

// ---- Communicator ----

Communicator::Communicator(std::shared_ptr<PointToPoint> transport, CommOptions options)
    : Communicator(std::make_shared<Engine>(transport), 0, transport->rank(), {}, options, nullptr, nullptr) {
  const int n = transport->size();
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  ranks_ = std::make_shared<const std::vector<int>>(std::move(all));
  if (!opts_.hosts.empty() && static_cast<int>(opts_.hosts.size()) != n)
    throw usage_error("CommOptions::hosts names the hosts of {} ranks but the transport has {}", opts_.hosts.size(), n);
  std::vector<int> hosts = opts_.hosts;
  if (hosts.empty())
    for (int i = 0; i < n; ++i) hosts.push_back(transport->host_of(i));
  set_hosts(std::make_shared<const std::vector<int>>(std::move(hosts)));
  if (!opts_.params_set) {
    // Operation #0 on every rank: agree on the parameters (every rank must choose alike).
    agreed_ = std::make_shared<CostModel>();
    auto agreed = agreed_;
    CostModel proposal = params_;
    bool measure = opts_.measure;
    params_work_ = submit(Desc{{OpKind::kAgreeCostModel, DataType::kF64, ReduceOp::kMax, -1, 0}},
                          [agreed, proposal, measure, hosts = hosts_](algo::Context& c) {
                            *agreed = agree_on_params(c, proposal, measure, *hosts);
                          });
  }
}

void Communicator::set_hosts(std::shared_ptr<const std::vector<int>> world_hosts) {
  world_hosts_ = std::move(world_hosts);
  std::vector<int> mine;
  for (int r : *ranks_) mine.push_back((*world_hosts_)[r]);
  layout_ = trn::host_layout(mine);
  hosts_ = std::make_shared<const std::vector<int>>(std::move(mine));
}

const CostModel& Communicator::cost_model() const {
  if (params_work_) {
    params_work_->wait(Deadline::after(timeout()));
    params_work_.reset();
    params_ = *agreed_;
    log::debug(log::Subsys::kColl, "communicator {}: rank {} of {} ({}) over {}; all-reduce choice: {}", id_, rank_,
               size(), layout_.describe(), engine_->transport().describe(),
               opts_.algo == Algo::kAuto ? describe_crossovers(layout_, params_) : to_string(opts_.algo));
  }
  return params_;
}

Communicator::Communicator(std::shared_ptr<Engine> engine, uint32_t id, int rank, std::vector<int> ranks,
                           CommOptions opts, const CostModel* agreed, std::shared_ptr<const std::vector<int>> world_hosts)
    : engine_(std::move(engine)),
      id_(id),
      rank_(rank),
      ranks_(std::make_shared<const std::vector<int>>(std::move(ranks))),
      opts_(opts) {
  if (opts_.algo == Algo::kAuto) opts_.algo = algo_from_environment();
  if (opts_.a2a_algo == A2aAlgo::kAuto) opts_.a2a_algo = a2a_algo_from_environment();
  check_ = opts_.check || settings::get_bool("TRN_CHECK_COLLECTIVES");
  if (opts_.timeout <= Duration::zero()) opts_.timeout = default_timeout();  // TRN_TIMEOUT, read once
  params_ = agreed ? *agreed : opts_.params_set ? opts_.params : model_for_transport(engine_->transport().describe());
  if (world_hosts) set_hosts(std::move(world_hosts));
}

Communicator::~Communicator() = default;

size_t Communicator::chunk_bytes() const {
  if (opts_.chunk_bytes) return opts_.chunk_bytes;
  // Before the agreement is submitted (operation #0 itself, which does not chunk) this is the
  // local proposal; afterwards the agreed value, which every rank shares.
  return static_cast<size_t>(flat_params(layout_, cost_model()).chunk_kib * 1024);
}

std::vector<size_t> Communicator::a2a_chunks() const {
  const int n = size();
  if (opts_.chunk_bytes) return std::vector<size_t>(n, opts_.chunk_bytes);
  const CostModel& m = cost_model();
  const size_t intra = a2a_chunk_bytes(m.intra), inter = a2a_chunk_bytes(m.inter);
  std::vector<size_t> chunks(n);
  for (int i = 0; i < n; ++i) chunks[i] = (*hosts_)[i] == (*hosts_)[rank_] ? intra : inter;
  return chunks;
}

Duration Communicator::timeout() const { return opts_.timeout; }

Algo Communicator::algorithm_for(size_t bytes) const {
  if (opts_.algo == Algo::kHier && !layout_.hier_possible())
    throw usage_error("all-reduce algorithm hier: communicator {} has {}, but the hierarchical all-reduce needs the "
                      "same number of ranks on every host (use ring, tree, rhd or auto)", id_, layout_.describe());
  if (opts_.algo != Algo::kAuto) return opts_.algo;
  if (bytes == last_choice_.first) return last_choice_.second;  // loops repeat one size
  const CostModel& model = cost_model();
  Algo a = choose_allreduce(layout_, bytes, model);
  last_choice_ = {bytes, a};
  if (log::enabled(log::Subsys::kColl, spdlog::level::debug)) {
    int bucket = std::bit_width(bytes);
    if (logged_buckets_.insert(bucket).second) {
      std::string hier = layout_.hierarchical()
                             ? fmt::format(", hier {:.1f} us", allreduce_cost_us(Algo::kHier, layout_, bytes, model))
                             : "";
      log::debug(log::Subsys::kColl,
                 "communicator {} ({} ranks, {}): all-reduce of {}..{} B runs {} (model: ring {:.1f} us, "
                 "tree {:.1f} us, rhd {:.1f} us{})",
                 id_, size(), layout_.describe(), bucket ? size_t{1} << (bucket - 1) : 0, (size_t{1} << bucket) - 1,
                 to_string(a), allreduce_cost_us(Algo::kRing, layout_, bytes, model),
                 allreduce_cost_us(Algo::kTree, layout_, bytes, model),
                 allreduce_cost_us(Algo::kRhd, layout_, bytes, model), hier);
    }
  }
  return a;
}

void Communicator::set_algorithm(Algo a) { opts_.algo = a == Algo::kAuto ? algo_from_environment() : a; }

A2aAlgo Communicator::a2a_algorithm_for(size_t send_bytes, size_t recv_bytes) const {
  return choose_all_to_all_v(opts_.a2a_algo, send_bytes, recv_bytes);
}

void Communicator::set_a2a_algorithm(A2aAlgo a) {
  opts_.a2a_algo = a == A2aAlgo::kAuto ? a2a_algo_from_environment() : a;
}

WorkPtr Communicator::submit(const Desc& d, std::function<void(algo::Context&)> run) {
  const uint64_t seq = seq_++;
  auto state = std::make_shared<WorkState>(OpLabel{OpLabel::Kind::kCollective, d, seq, id_, -1});
  Engine* eng = engine_.get();
  engine_->submit(state, [eng, seq, d, run = std::move(run), ranks = ranks_, rank = rank_, id = id_,
                          check = check_, chunk = chunk_bytes(), to = timeout()] {
    algo::Context c(eng->transport(), *ranks, rank, id, seq, Deadline::after(to), chunk, eng->scratch());
    if (check) check_same_call(c, id, seq, d);
    run(c);
  });
  return std::make_shared<Work>(state, timeout(), engine_);
}

void Communicator::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= size())
    throw usage_error("{}: rank {} is not in the communicator (size {})", what, peer, size());
}

WorkPtr Communicator::all_reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  const size_t bytes = count * size_of(t);
  const Algo a = algorithm_for(bytes);
  Desc d{{OpKind::kAllReduce, t, op, -1, count}};
  const int n = size();
  // With the default chunk the transport may send small enough segments whole (cost_model.h).
  const size_t segment = (count + n - 1) / n * size_of(t);
  const size_t ring_chunk =
      opts_.chunk_bytes ? opts_.chunk_bytes
                        : ring_chunk_bytes(flat_params(layout_, cost_model()), chunk_bytes(), segment);
  if (a == Algo::kHier) {
    // Phase 1 and 3 rings run over the host's pieces, phase 2's over the pieces of a piece.
    const CostModel& m = cost_model();
    const int per_host = std::max(layout_.per_host, 1);
    const size_t piece = (count + per_host - 1) / per_host * size_of(t);
    auto chunk_of = [&](const CostParams& p, size_t seg_bytes) {
      return opts_.chunk_bytes ? opts_.chunk_bytes
                               : ring_chunk_bytes(p, static_cast<size_t>(p.chunk_kib * 1024), seg_bytes);
    };
    algo::HierPlan plan{chunk_of(m.intra, piece), chunk_of(m.inter, (piece + layout_.hosts - 1) / layout_.hosts),
                        hier_cross_algo(layout_, bytes, m), hier_cross_doubling_max_bytes(layout_, m)};
    return submit(d, [=, hosts = hosts_](algo::Context& c) {
      algo::allreduce_hier(c, *hosts, in, out, count, t, op, plan);
      if (op == ReduceOp::kAvg) finish_avg(out, count, t, n);
    });
  }
  const size_t doubling_max = a == Algo::kRhd ? rhd_doubling_max_bytes(n, flat_params(layout_, cost_model())) : 0;
  auto w = submit(d, [=](algo::Context& c) {
    if (a != Algo::kTree && a != Algo::kRhd) {
      algo::Context rc = c.with_chunk_bytes(ring_chunk);
      algo::allreduce_ring(rc, in, out, count, t, op);  // reads in directly: no copy first
    } else {
      if (in != out && bytes) std::memcpy(out, in, bytes);
      if (a == Algo::kTree) algo::allreduce_tree(c, out, count, t, op);
      else algo::allreduce_rhd(c, out, count, t, op, doubling_max);
    }
    if (op == ReduceOp::kAvg) finish_avg(out, count, t, n);
  });
  return w;
}

WorkPtr Communicator::reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op) {
  const int n = size();
  return submit(Desc{{OpKind::kReduceScatter, t, op, -1, count}}, [=](algo::Context& c) {
    algo::reduce_scatter_ring(c, in, out, count, t, op);
    if (op == ReduceOp::kAvg) finish_avg(out, count, t, n);
  });
}

WorkPtr Communicator::all_reduce_e4m3(const float* in, float* out, size_t count, ReduceOp op, float* residual,
                                      Fp8Format fmt) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw usage_error("all_reduce_e4m3: the reduction must be sum or avg (got {})", to_string(op));
  return submit(Desc{{OpKind::kAllReduceE4M3, DataType::kF32, op, -1, count}}, [=](algo::Context& c) {
    algo::allreduce_e4m3(c, in, out, count, op == ReduceOp::kAvg, residual, fmt);
  });
}

WorkPtr Communicator::reduce_scatter_e4m3(const float* in, float* out, size_t count, ReduceOp op,
                                          float* residual, Fp8Format fmt) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw usage_error("reduce_scatter_e4m3: the reduction must be sum or avg (got {})", to_string(op));
  return submit(Desc{{OpKind::kReduceScatterE4M3, DataType::kF32, op, -1, count}}, [=](algo::Context& c) {
    algo::reduce_scatter_e4m3(c, in, out, count, op == ReduceOp::kAvg, residual, fmt);
  });
}

WorkPtr Communicator::all_gather(const void* in, void* out, size_t count, DataType t) {
  const size_t block = count * size_of(t);
  const int r = rank_;
  return submit(Desc{{OpKind::kAllGather, t, ReduceOp::kSum, -1, count}}, [=](algo::Context& c) {
    char* mine = static_cast<char*>(out) + block * r;
    if (mine != in && block) std::memmove(mine, in, block);
    algo::all_gather_ring(c, out, block);
  });
}

WorkPtr Communicator::broadcast(void* buf, size_t count, DataType t, int root) {
  check_peer(root, "broadcast root");
  const size_t bytes = count * size_of(t);
  return submit(Desc{{OpKind::kBroadcast, t, ReduceOp::kSum, root, count}},
                [=](algo::Context& c) { algo::broadcast(c, buf, bytes, root); });
}

WorkPtr Communicator::reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op, int root) {
  check_peer(root, "reduce root");
  const size_t bytes = count * size_of(t);
  const bool is_root = rank_ == root;
  const int n = size();
  return submit(Desc{{OpKind::kReduce, t, op, root, count}}, [=](algo::Context& c) {
    void* buf = const_cast<void*>(in);  // only the root's buffer is written
    if (is_root) {
      if (in != out && bytes) std::memcpy(out, in, bytes);
      buf = out;
    }
    algo::reduce_chain(c, buf, count, t, op, root);
    if (is_root && op == ReduceOp::kAvg) finish_avg(out, count, t, n);
  });
}

WorkPtr Communicator::barrier() {
  return submit(Desc{{OpKind::kBarrier, DataType::kU8, ReduceOp::kSum, -1, 0}},
                [](algo::Context& c) { algo::barrier_dissemination(c); });
}

WorkPtr Communicator::all_to_all(const void* in, void* out, size_t count, DataType t) {
  // all_to_all_v's algorithms with equal blocks: chunked messages, direct or pairwise by size.
  const int n = size();
  size_t block;
  if (__builtin_mul_overflow(count, size_of(t), &block) || block > SIZE_MAX / std::max(n, 1))
    throw usage_error("all_to_all: {} blocks of {} elements are more bytes than memory holds", n, count);
  algo::AllToAllV x;
  x.send_bytes.assign(n, block);
  x.recv_bytes.assign(n, block);
  for (int i = 0; i < n; ++i) {
    x.send_off.push_back(block * i);
    x.recv_off.push_back(block * i);
  }
  x.in = static_cast<const char*>(in);
  x.out = static_cast<char*>(out);
  x.chunk = a2a_chunks();
  const size_t total = block * n;
  const bool overlap = total && x.in < x.out + total && x.out < x.in + total;  // in place, or nearly
  const bool pairwise = a2a_algorithm_for(total, total) == A2aAlgo::kPairwise;
  return submit(Desc{{OpKind::kAllToAll, t, ReduceOp::kSum, -1, count}},
                [x = std::move(x), overlap, total, pairwise](algo::Context& c) mutable {
                  if (overlap) {  // receives may land before the sends that read the same bytes
                    char* copy = c.scratch(total, 1);
                    std::memcpy(copy, x.in, total);
                    x.in = copy;
                  }
                  algo::all_to_all_v(c, x, pairwise);
                });
}

WorkPtr Communicator::all_to_all_v(const void* in, std::span<const size_t> send_counts,
                                   std::span<const size_t> send_displs, void* out,
                                   std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                                   DataType t) {
  const int n = size(), r = rank_;
  const size_t es = size_of(t);
  algo::AllToAllV x;
  side_of(send_counts, send_displs, es, n, "send_counts", "send_displs", x.send_bytes, x.send_off);
  side_of(recv_counts, recv_displs, es, n, "recv_counts", "recv_displs", x.recv_bytes, x.recv_off);
  if (send_counts[r] != recv_counts[r])
    throw usage_error("all_to_all_v: rank {} sends itself {} elements (send_counts[{}]) but receives {} "
                      "(recv_counts[{}])", r, send_counts[r], r, recv_counts[r], r);
  // The extent of each side's regions (empty regions touch nothing).
  size_t send_total = 0, recv_total = 0, send_lo = SIZE_MAX, send_hi = 0, recv_lo = SIZE_MAX, recv_hi = 0;
  std::vector<int> receivers;  // ranks with a non-empty receive region
  for (int i = 0; i < n; ++i) {
    if (x.send_bytes[i]) {
      send_total += x.send_bytes[i];
      send_lo = std::min(send_lo, x.send_off[i]);
      send_hi = std::max(send_hi, x.send_off[i] + x.send_bytes[i]);
    }
    if (x.recv_bytes[i]) {
      recv_total += x.recv_bytes[i];
      recv_lo = std::min(recv_lo, x.recv_off[i]);
      recv_hi = std::max(recv_hi, x.recv_off[i] + x.recv_bytes[i]);
      receivers.push_back(i);
    }
  }
  if (send_total && !in) throw usage_error("all_to_all_v: in is null but send_counts are not all zero");
  if (recv_total && !out) throw usage_error("all_to_all_v: out is null but recv_counts are not all zero");
  std::sort(receivers.begin(), receivers.end(), [&](int a, int b) { return x.recv_off[a] < x.recv_off[b]; });
  for (size_t k = 1; k < receivers.size(); ++k) {
    const int a = receivers[k - 1], b = receivers[k];
    if (x.recv_off[a] + x.recv_bytes[a] > x.recv_off[b])
      throw usage_error("all_to_all_v: the receive regions from ranks {} and {} overlap (elements [{}, {}) and [{}, {}))",
                        a, b, x.recv_off[a] / es, (x.recv_off[a] + x.recv_bytes[a]) / es, x.recv_off[b] / es,
                        (x.recv_off[b] + x.recv_bytes[b]) / es);
  }
  for (int i = 0; i < n; ++i) {  // empty regions: no address to reason about (in and out may be null)
    if (!x.send_bytes[i]) x.send_off[i] = 0;
    if (!x.recv_bytes[i]) x.recv_off[i] = 0;
  }
  x.in = static_cast<const char*>(in);
  x.out = static_cast<char*>(out);
  x.chunk = a2a_chunks();
  // Sends that overlap the receive regions (in place, or nearly) go from a copy, as a receive
  // may land before the send that reads the same bytes left.
  const bool overlap = send_total && recv_total && x.in + send_lo < x.out + recv_hi && x.out + recv_lo < x.in + send_hi;
  const bool pairwise = a2a_algorithm_for(send_total, recv_total) == A2aAlgo::kPairwise;
  return submit(Desc{{OpKind::kAllToAllV, t, ReduceOp::kSum, -1, 0}},
                [x = std::move(x), overlap, send_lo, send_hi, pairwise, check = check_, es](algo::Context& c) mutable {
                  if (check) check_all_to_all_v_counts(c, x.send_bytes, x.recv_bytes, es);
                  if (overlap) {
                    char* copy = c.scratch(send_hi - send_lo, 1);
                    std::memcpy(copy, x.in + send_lo, send_hi - send_lo);
                    x.in = copy;
                    for (size_t i = 0; i < x.send_off.size(); ++i)
                      if (x.send_bytes[i]) x.send_off[i] -= send_lo;
                  }
                  algo::all_to_all_v(c, x, pairwise);
                });
}

WorkPtr Communicator::all_to_all_counts(std::span<const size_t> send_counts, std::span<size_t> recv_counts) {
  static_assert(sizeof(size_t) == sizeof(int64_t), "counts travel as i64");
  if (send_counts.size() != static_cast<size_t>(size()) || recv_counts.size() != static_cast<size_t>(size()))
    throw usage_error("all_to_all_counts: send_counts has {} entries and recv_counts {}, but the communicator has {} "
                      "ranks", send_counts.size(), recv_counts.size(), size());
  return all_to_all(send_counts.data(), recv_counts.data(), 1, DataType::kI64);
}

WorkPtr Communicator::send(const void* buf, size_t count, DataType t, int peer, Duration op_timeout) {
  if (op_timeout <= Duration::zero()) op_timeout = timeout();
  check_peer(peer, "send");
  const size_t bytes = count * size_of(t);
  const uint64_t tg = tag::p2p(id_, sent_[peer]++);
  const int to = (*ranks_)[peer];
  auto state = std::make_shared<WorkState>(
      OpLabel{OpLabel::Kind::kSend, CallDesc{OpKind::kBarrier, t, ReduceOp::kSum, -1, count}, 0, id_, peer});
  Engine* eng = engine_.get();
  engine_->submit_p2p(
      state, [=] { return eng->transport().isend(to, tg, buf, bytes); }, [](Request&) {}, op_timeout);
  return std::make_shared<Work>(state, op_timeout);
}

WorkPtr Communicator::recv(void* buf, size_t count, DataType t, int peer, Duration op_timeout) {
  if (op_timeout <= Duration::zero()) op_timeout = timeout();
  check_peer(peer, "recv");
  const size_t bytes = count * size_of(t);
  const uint64_t tg = tag::p2p(id_, received_[peer]++);
  const int from = (*ranks_)[peer];
  auto state = std::make_shared<WorkState>(
      OpLabel{OpLabel::Kind::kRecv, CallDesc{OpKind::kBarrier, t, ReduceOp::kSum, -1, count}, 0, id_, peer});
  Engine* eng = engine_.get();
  engine_->submit_p2p(
      state, [=] { return eng->transport().irecv(from, tg, buf, bytes); },
      [bytes](Request& rq) {
        if (rq.bytes() != bytes)
          throw usage_error("received {} bytes but expected {}: sender and receiver disagree on the count",
                            rq.bytes(), bytes);
      },
      op_timeout);
  return std::make_shared<Work>(state, op_timeout);
}

std::shared_ptr<Communicator> Communicator::split(int color, int key) {
  struct Entry {
    int32_t color, key;
    uint32_t next_id, pad;
  };
  struct Result {
    std::vector<int> ranks;  // transport ranks of the new group
    int rank = -1;
    uint32_t id = 0;
  };
  auto res = std::make_shared<Result>();
  Engine* eng = engine_.get();
  const int n = size(), me = rank_;
  const std::shared_ptr<const std::vector<int>> parent = ranks_;
  auto w = submit(Desc{{OpKind::kSplit, DataType::kU8, ReduceOp::kSum, -1, 0}}, [=](algo::Context& c) {
    std::vector<Entry> all(n);
    all[me] = Entry{color, key, eng->comm_ids()->load(), 0};
    algo::all_gather_ring(c, all.data(), sizeof(Entry));
    if (color < 0) return;
    std::vector<int> members;
    uint32_t id = 0;
    for (int i = 0; i < n; ++i)
      if (all[i].color == color) members.push_back(i), id = std::max(id, all[i].next_id);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[a].key < all[b].key; });
    if (id >= tag::kMaxCommIds)
      throw usage_error("too many communicators ({}): at most {} splits per process", id, tag::kMaxCommIds - 1);
    std::atomic<uint32_t>& next = *eng->comm_ids();
    for (uint32_t seen = next.load(); seen <= id && !next.compare_exchange_weak(seen, id + 1);) {
    }
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == me) res->rank = static_cast<int>(i);
      res->ranks.push_back((*parent)[members[i]]);
    }
    res->id = id;
  });
  w->wait(Deadline::after(timeout() + std::chrono::seconds(1)));
  if (color < 0) return nullptr;
  // The child runs on an engine of its own over the same transport (engine.h).
  auto engine = std::make_shared<Engine>(engine_->shared_transport(), engine_->comm_ids());
  auto child = std::shared_ptr<Communicator>(
      new Communicator(std::move(engine), res->id, res->rank, res->ranks, opts_, &cost_model(), world_hosts_));
  log::debug(log::Subsys::kColl, "communicator {} split (color {}, key {}) into communicator {}: rank {} of {}", id_,
             color, key, res->id, res->rank, res->ranks.size());
  return child;
}

void Communicator::abort(const std::string& reason) { engine_->abort(reason); }
bool Communicator::aborted() const { return engine_->failed(); }

}  // namespace trn
