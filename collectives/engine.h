// The thread that runs a communicator's operations (internal to the communicator). One per
// communicator: the world communicator and every communicator split from it each have their own,
// all over the one world transport, so operations on one communicator run strictly in
// submission order while operations on different communicators never wait for each other (as
// NCCL's one stream per communicator). Two ranks may then issue on two communicators in
// opposite orders without deadlock, and a tensor-parallel all-reduce never queues behind
// data-parallel buckets. When the queue runs empty it keeps polling it for TRN_COLL_POLL_US, yielding
// the core between polls, then sleeps on a condition variable: a caller that issues one blocking
// collective after another then never pays a thread wake-up (on a virtual machine, tens of
// microseconds) on either side.
//
// Point-to-point operations are only posted in order: the engine moves on to the next task at
// once and completes them when their message is done (so a send does not hold back the receive
// queued after it), in issue order among those with the same peer and direction. A collective starts only after every earlier point-to-point operation
// completed. While only point-to-point operations are pending the engine polls them with naps
// that grow from 20 us to 1 ms, so it stays responsive without spinning.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "collectives/algorithms/algorithm.h"
#include "collectives/check.h"
#include "collectives/core/error.h"
#include "collectives/p2p.h"

namespace trn {

// What an operation is, in a form cheap to fill per call; format() spells it out for errors:
// "all_reduce(count=10, f32, sum) #12 on communicator 0", "send of 4 x f32 to rank 1 on
// communicator 0".
struct OpLabel {
  enum class Kind : uint8_t { kCollective, kSend, kRecv };
  Kind kind = Kind::kCollective;
  CallDesc call;     // the collective; for send and receive, count and dtype
  uint64_t seq = 0;  // operation number on the communicator (collectives)
  uint32_t comm = 0;
  int peer = -1;     // send and receive
  std::string format() const;
};

// TRN_COLL_POLL_US: how long the engine thread polls an empty queue, and Work::wait polls for
// completion, yielding the core between polls, before they sleep.
Duration coll_poll_window();

// Decides whether a yield-poll (TRN_COLL_POLL_US) is worth its core. Polling keeps a thread on
// a core until its event comes, which pays when the event comes within the window (no wake-up
// to wait for) and only takes the core from compute when it comes later: on a machine whose
// cores the ranks all claim, from another rank's kernels (also from ranks in other network
// namespaces or containers, which no count of the ranks on a host shows). So a poll that ran out
// of its window kSkipAfter times in a row is skipped (the poller sleeps at once), except every
// kProbeEvery-th, which finds out whether events come quickly again; a poll that catches its
// event resets the count. One thread's.
class PollGovernor {
 public:
  static constexpr int kSkipAfter = 4;
  static constexpr int kProbeEvery = 16;
  bool should_poll() { return misses_ < kSkipAfter || ++skipped_ % kProbeEvery == 0; }
  void record(bool caught) { misses_ = caught ? 0 : std::min(misses_ + 1, kSkipAfter); }

 private:
  int misses_ = 0;
  uint32_t skipped_ = 0;
};

struct WorkState {
  explicit WorkState(const OpLabel& l) : label(l) {}
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<bool> done{false};  // set under mu (after error); read without it by polling waiters
  std::optional<Error> error;
  const OpLabel label;
  // When the engine began running it and when it ended (set before done): its time on the wire,
  // apart from the time it waited in the queue.
  std::chrono::steady_clock::time_point started{}, finished{};
  // label.format(), formatted on first use (errors, Work::what()) rather than per call.
  const std::string& what();

 private:
  std::once_flag what_once_;
  std::string what_;
};

class Engine {
 public:
  // ids: the process-wide counter of communicator ids over this transport, shared by every engine
  // split from the same world (null: a new counter starting at 1).
  explicit Engine(std::shared_ptr<PointToPoint> transport,
                  std::shared_ptr<std::atomic<uint32_t>> ids = nullptr);
  ~Engine();

  PointToPoint& transport() { return *transport_; }
  const std::shared_ptr<PointToPoint>& shared_transport() const { return transport_; }
  const std::shared_ptr<std::atomic<uint32_t>>& comm_ids() const { return ids_; }
  algo::Scratch& scratch() { return scratch_; }
  // Runs fn on the engine thread after everything submitted before; state completes with fn's
  // outcome. After a failure or abort every later fn is skipped and its state fails.
  void submit(std::shared_ptr<WorkState> state, std::function<void()> fn);
  // Point-to-point: post() starts it; done(request) runs once it completed (and may throw).
  void submit_p2p(std::shared_ptr<WorkState> state, std::function<RequestPtr()> post,
                  std::function<void(Request&)> done, Duration timeout);
  void abort(const std::string& reason);
  // True once this engine failed or the shared transport was aborted (by any communicator).
  bool failed() const;
  // Runs state's collective on the calling thread when it is next in line and the engine is
  // idle (no task running, no point-to-point operation pending); false otherwise. A caller that
  // waits right after submitting (a blocking collective) then needs no hand-off to the engine
  // thread and back, which costs more than a small all-reduce on a busy host. The engine leaves
  // a lone new collective alone for kClaimGrace so that such a caller gets to it first.
  bool run_inline(const WorkState* state);
  static constexpr Duration kClaimGrace = std::chrono::microseconds(5);
  // Blocking style: once kBlockingStreak collectives in a row were run inline by their callers,
  // a lone collective submitted while the engine sleeps idle does not wake it (a wake-up and the
  // switch to the engine thread cost more than a small all-reduce when ranks outnumber cores;
  // bench/results/2026-11-30-blocking-calls.md). The idle engine then wakes every
  // kIdleTick instead, so such a collective still starts within a tick if nobody waits for it.
  // In blocking style the engine also leaves a lone collective to its caller for kIdleTick
  // rather than kClaimGrace, sleeping meanwhile (a lone collective submitted during that sleep,
  // once the caller claimed the one before, does not wake it either), it does not poll for work
  // when idle (the poll would find only collectives it leaves to their callers, and take turns
  // with them on their core), and a caller that waits for a collective the engine thread took
  // anyway still counts toward the streak. Only collectives queued behind one
  // another, or one nobody came for within a tick, end the style. Otherwise a caller descheduled
  // between submit and wait (ranks outnumbering cores, or a rank's threads sharing one) lost
  // its collective to the engine thread, which then ran every collective while the caller
  // yielded on the same cores.
  static constexpr int kBlockingStreak = 4;
  static constexpr Duration kIdleTick = std::chrono::milliseconds(1);
  // Wakes the engine for a collective that waits unannounced in the queue (Work::test polls).
  void kick();

 private:
  struct Task {
    std::shared_ptr<WorkState> state;
    Clock::time_point queued_at;
    std::function<void()> fn;              // a collective, or
    std::function<RequestPtr()> post;      // a point-to-point operation
    std::function<void(Request&)> done;
    Duration timeout{};
  };
  struct Pending {
    std::shared_ptr<WorkState> state;
    RequestPtr request;
    std::function<void(Request&)> done;
    Deadline deadline;
  };
  void loop();
  // Runs body; on an Error fails state and the engine. Returns false on failure.
  bool guarded(WorkState& state, const std::function<void()>& body);
  void poll_pending();      // completes the pending operations that are done
  void wait_all_pending();  // waits for every pending operation
  // Queues t, or fails it at once when the engine has already failed.
  void enqueue(Task t);
  void fail_locked(const Error& e);
  // Polls the queue for poll_, yielding the core; true when work (or a stop) arrived.
  bool poll_for_work();
  // Sleeps on cv_ until notified, in blocking style (kBlockingStreak) at most kIdleTick.
  void sleep_locked(std::unique_lock<std::mutex>& lock);
  static void finish(WorkState& s, std::optional<Error> error);

  std::shared_ptr<PointToPoint> transport_;
  // Smallest communicator id not yet used in this process over transport_ (split() reads and
  // raises it; splits of communicators sharing processes are issued in one order on every rank).
  std::shared_ptr<std::atomic<uint32_t>> ids_;
  algo::Scratch scratch_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  std::deque<Pending> pending_;  // engine thread only
  bool running_task_ = false;  // the engine thread or an inline caller runs a task
  bool has_pending_ = false;   // !pending_.empty(), readable under mu_
  bool ticking_ = false;       // the engine thread sleeps waking every kIdleTick
  bool claim_wait_ = false;    // it sleeps until a lone collective's kIdleTick for its caller ran out
  int inline_streak_ = 0;      // collectives in a row that their callers waited for at once
  const WorkState* engine_state_ = nullptr;  // the collective the engine thread runs
  bool stop_ = false;
  std::optional<Error> failure_;
  const Duration poll_;  // TRN_COLL_POLL_US
  // The engine thread's poll for work. Idle in blocking style, the engine wakes every kIdleTick
  // and would poll after each wake-up, spending a share of a core on yielding that ranks sharing
  // the machine's cores then miss (bench/results/2026-12-04-idle-poll.md).
  PollGovernor idle_poll_;
  std::thread thread_;
};

}  // namespace trn
