// trn::Communicator (DESIGN.md layer 3): a group of ranks and the collectives among them.
//
//   auto comm = std::make_shared<trn::Communicator>(transport);   // world, from a PointToPoint
//   auto w = comm->all_reduce(grad, grad, n, trn::DataType::kF32, trn::ReduceOp::kAvg);
//   ...compute...
//   w->wait();                                                   // or w->test() to poll
//
// Every operation is asynchronous: it is queued and returns a Work handle at once. Each
// communicator has its own engine thread (the world and every communicator split from it, all
// over one transport) that runs its queue in issue order, so operations on one communicator
// complete in issue order, and operations on different communicators progress independently:
// ranks may issue on two communicators in different orders. The thread sleeps while idle and its
// waits block in the transport. Buffers must stay valid and untouched until the Work completes.
// In-place: pass the same pointer as input and output (reduce_scatter: out == in + rank*count;
// all_gather: in == out + rank*count).
//
// Failure is final: an operation that fails (a peer died, a deadline passed) or abort(reason)
// aborts the transport and fails every queued and later operation on every communicator that
// shares it. Fault recovery then builds a new transport and communicator.
//
// With TRN_CHECK_COLLECTIVES=1 each collective first exchanges a descriptor (operation, count,
// type, reduction, root) with every member; a mismatch fails the operation on every rank with
// a usage error naming the ranks and what each called.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "collectives/core/deadline.h"
#include "collectives/cost_model.h"
#include "collectives/dtype.h"
#include "collectives/fp8.h"
#include "collectives/p2p.h"

namespace trn {
namespace algo {
class Context;
}

class Engine;
struct WorkState;

// The handle of one queued operation.
class Work {
 public:
  // engine: set for collectives, which a waiting caller may run itself (Engine::run_inline).
  // timeout: the operation's own deadline, counted from when it starts (CommOptions::timeout).
  Work(std::shared_ptr<WorkState> s, Duration timeout, std::weak_ptr<Engine> engine = {})
      : s_(std::move(s)), engine_(std::move(engine)), timeout_(timeout) {}
  // True once the operation completed; throws its Error if it failed.
  bool test();
  // Waits until the operation completes; throws its Error if it failed, or a timeout Error
  // naming the operation when deadline passes first (the operation keeps running). When the
  // operation is a collective next in line and the engine is idle, the calling thread runs it.
  void wait(Deadline deadline);
  // Waits for the operation to end. It fails by itself once its own deadline passes, so this
  // wait's deadline (twice that timeout, plus a second) is only a safety net: when the operation
  // fails, the caller gets its error and may free its buffers at once, as the operation has
  // stopped touching them.
  void wait() { wait(Deadline::after(2 * timeout_ + std::chrono::seconds(1))); }
  // "all_reduce #12 (1048576 x f32 sum, ring)".
  const std::string& what() const;
  // Once it completed: when it started running and when it ended (not the time queued).
  std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point> ran() const;

 private:
  std::shared_ptr<WorkState> s_;
  std::weak_ptr<Engine> engine_;
  Duration timeout_;
};
using WorkPtr = std::shared_ptr<Work>;

struct CommOptions {
  Algo algo = Algo::kAuto;           // all-reduce algorithm; kAuto: TRN_ALGO, then the cost model
  A2aAlgo a2a_algo = A2aAlgo::kAuto;  // all_to_all_v algorithm; kAuto: TRN_A2A_ALGO, then by size
  // Pipeline chunk of ring, tree, chain broadcast and reduce, and when set also the all-to-alls'
  // chunk with every member; 0: the cost model's, agreed by all ranks (256 KiB over shm and tcp,
  // 512 KiB over efa; all-to-all 1 MiB over tcp: a2a_chunks). Must be the same on every rank.
  size_t chunk_bytes = 0;
  Duration timeout{};                // per operation; zero: TRN_TIMEOUT
  bool check = false;                // force the TRN_CHECK_COLLECTIVES checks on
  // Use params instead of model_for_transport(). Must be the same on every rank: the algorithm
  // and rhd's doubling bound (rhd_doubling_max_bytes) are chosen from them on each rank, and
  // stated params skip the agreement measured ones go through.
  bool params_set = false;
  CostModel params;
  bool measure = false;              // measure the transport at construction (calibrate.h)
  // The host of each transport rank (any number naming it); empty: the transport's host_of.
  // Lets tests group the processes of one machine as if they ran on several hosts. Must be the
  // same on every rank (the first operation checks).
  std::vector<int> hosts;
};

class Communicator {
 public:
  // The world communicator over transport: rank and size are the transport's. Every rank
  // constructs its own; the first operation of each agrees on the cost model's parameters
  // (calibrate.h), so the first all-reduce waits for every rank to have constructed.
  explicit Communicator(std::shared_ptr<PointToPoint> transport, CommOptions options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(ranks_->size()); }
  uint32_t id() const { return id_; }
  const CommOptions& options() const { return opts_; }
  // The transport rank of each member, in communicator rank order.
  const std::vector<int>& world_ranks() const { return *ranks_; }

  // Collective over this communicator: ranks passing the same color form a new communicator,
  // ordered by (key, rank here), with its own engine thread. A negative color returns nullptr
  // (the rank joins none). Blocks until done (deadline: the operation timeout). Splits of
  // communicators that share processes must be issued in the same order on every rank, one at
  // a time (as at setup): the new id is agreed from each member's next free id.
  std::shared_ptr<Communicator> split(int color, int key);

  WorkPtr all_reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op);
  // in: size() blocks of count elements; out: count elements, block rank() reduced.
  WorkPtr reduce_scatter(const void* in, void* out, size_t count, DataType t, ReduceOp op);
  // in: count elements; out: size() blocks of count, block i from rank i.
  WorkPtr all_gather(const void* in, void* out, size_t count, DataType t);
  WorkPtr broadcast(void* buf, size_t count, DataType t, int root);
  // out is written at root only (it may be null elsewhere).
  WorkPtr reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op, int root);
  WorkPtr barrier();
  // f32 all-reduce and reduce-scatter (as above) with fp8 on the wire: every rank's input is
  // rounded to e4m3 at a power-of-two scale per 128 elements (collectives/fp8.h), the parts are
  // summed in f32 in rank order by the rank that owns them, and the all-reduce's sums are rounded
  // to e4m3 once more for the all-gather. Bit-identical on every rank; op is kSum or kAvg.
  // residual: null, or error feedback laid out like in (count floats; reduce-scatter: size() *
  // count), zero at first: each call adds it to the input before encoding and leaves in it what
  // this rank's encoding lost, so over many calls the rounding errors of the input cancel.
  // fmt: the E4M3 format on the wire (ocp, max 448; neuron, Trainium2's, max 240), the same on
  // every rank.
  WorkPtr all_reduce_e4m3(const float* in, float* out, size_t count, ReduceOp op, float* residual = nullptr,
                          Fp8Format fmt = Fp8Format::kOCP);
  WorkPtr reduce_scatter_e4m3(const float* in, float* out, size_t count, ReduceOp op,
                              float* residual = nullptr, Fp8Format fmt = Fp8Format::kOCP);
  // in and out: size() blocks of count elements; block j of in goes to rank j. Runs
  // all_to_all_v's algorithms (a2a_algorithm_for) with equal blocks.
  WorkPtr all_to_all(const void* in, void* out, size_t count, DataType t);
  // Variable-size all-to-all, MPI_Alltoallv's contract: send_counts[j] elements from
  // in + send_displs[j] go to rank j; recv_counts[i] elements from rank i land at
  // out + recv_displs[i]. Counts and displacements count elements of t and have size() entries;
  // empty displacements mean packed in rank order (the prefix sums of the counts). Counts may be
  // zero. recv_counts[i] must equal rank i's send_counts[rank()] (agree on them first, e.g. with
  // all_to_all_counts): every pair exchanges exactly one message, empty ones too, so a receive
  // that disagrees with its sender fails the operation rather than dropping data. Receive regions
  // must not overlap one another; send regions may, and in may overlap out (the sends are then
  // copied aside first). The arrays are copied at the call; the buffers must stay valid until the
  // Work completes. Bad arguments are one usage error at the call. With TRN_CHECK_COLLECTIVES a
  // disagreement between ranks' counts fails the operation on every rank, naming both. The
  // algorithm: a2a_algorithm_for.
  WorkPtr all_to_all_v(const void* in, std::span<const size_t> send_counts, std::span<const size_t> send_displs,
                       void* out, std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                       DataType t);
  // Expert parallelism's first step before an all_to_all_v: each rank says how many elements it
  // will send each rank (send_counts[j]) and learns how many each will send it (recv_counts[i]).
  // An all_to_all of one 64-bit count per rank; both arrays have size() entries and must stay
  // valid until the Work completes.
  WorkPtr all_to_all_counts(std::span<const size_t> send_counts, std::span<size_t> recv_counts);
  // Point-to-point within the communicator; messages between two ranks match in issue order.
  // They are posted in queue order but do not hold the queue back: a send completes once the
  // peer received it, so send-then-receive on every rank of a ring does not deadlock. A later
  // collective waits for them.
  // timeout: the operation's own deadline, counted from when it is posted (zero: the
  // communicator's). A receive posted long before its message is due (a pipeline posts a whole
  // step's) takes a longer one and its waiter applies the usual deadline itself.
  WorkPtr send(const void* buf, size_t count, DataType t, int peer, Duration timeout = {});
  WorkPtr recv(void* buf, size_t count, DataType t, int peer, Duration timeout = {});

  // The all-reduce algorithm this communicator runs for bytes (override or cost model). A forced
  // hier on a layout that cannot run it (hosts with different numbers of ranks) is a usage
  // error.
  Algo algorithm_for(size_t bytes) const;
  // The cost model's parameters, identical on every rank (waits for the agreement).
  const CostModel& cost_model() const;
  // How the members sit on hosts, identical on every rank.
  const HostLayout& host_layout() const { return layout_; }
  // All-reduces issued from now on run a (kAuto: TRN_ALGO, then the cost model).
  void set_algorithm(Algo a);
  // The all_to_all_v algorithm this rank runs when it sends send_bytes and receives recv_bytes
  // in all: CommOptions::a2a_algo or TRN_A2A_ALGO when forced, else by size
  // (choose_all_to_all_v). Ranks may choose differently: the algorithms interoperate.
  A2aAlgo a2a_algorithm_for(size_t send_bytes, size_t recv_bytes) const;
  // all_to_all_v calls issued from now on run a (kAuto: TRN_A2A_ALGO, then by size).
  void set_a2a_algorithm(A2aAlgo a);

  // Fails every outstanding and future operation of every communicator sharing the transport.
  void abort(const std::string& reason);
  bool aborted() const;

 private:
  Communicator(std::shared_ptr<Engine> engine, uint32_t id, int rank, std::vector<int> ranks, CommOptions opts,
               const CostModel* agreed, std::shared_ptr<const std::vector<int>> world_hosts);
  void set_hosts(std::shared_ptr<const std::vector<int>> world_hosts);
  struct Desc;
  WorkPtr submit(const Desc& d, std::function<void(algo::Context&)> run);
  void check_peer(int peer, const char* what) const;
  Duration timeout() const;
  size_t chunk_bytes() const;
  // The all-to-alls' chunk with each member: CommOptions::chunk_bytes when set, else the cost
  // model's a2a chunk for the link to it (intra for members on this rank's host, else inter).
  std::vector<size_t> a2a_chunks() const;

  mutable std::pair<size_t, Algo> last_choice_{SIZE_MAX, Algo::kAuto};  // algorithm_for's last answer
  std::shared_ptr<Engine> engine_;
  uint32_t id_;
  int rank_;
  std::shared_ptr<const std::vector<int>> ranks_;  // shared with queued operations, never copied
  CommOptions opts_;
  bool check_;
  mutable CostModel params_;
  mutable WorkPtr params_work_;  // the agreement, until awaited
  std::shared_ptr<CostModel> agreed_;
  std::shared_ptr<const std::vector<int>> world_hosts_;  // host of each transport rank
  std::shared_ptr<const std::vector<int>> hosts_;        // host of each member
  HostLayout layout_;
  uint64_t seq_ = 0;
  std::map<int, uint64_t> sent_, received_;  // point-to-point message counts per peer
  mutable std::set<int> logged_buckets_;
};

}  // namespace trn
