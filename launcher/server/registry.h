// The coordinator's state: jobs, their rendezvous rounds and generations, heartbeats, the
// per-job key-value store and barriers, and the checkpoint registry. Knows nothing of gRPC:
// requests and replies are the API's protobuf messages, and calls that wait (join, get,
// barrier) take a completion callback instead of blocking a thread, so a thousand waiters cost
// a thousand small records. tick() (called every few tens of milliseconds) expires waits,
// completes settled rendezvous rounds and ends generations whose members stopped heartbeating.
//
// Generations: the first completed rendezvous of a job runs generation 0. A failure report, a
// member that misses heartbeats for heartbeat_timeout, or a new node joining a running job that
// has room ends the generation: the counter moves on, the job forms again, and every call from
// the old generation is answered with abort (heartbeats) or ABORTED (store, barrier, shards).
// Once every node called finish(), the job is completed and nothing ends it any more; a failure
// reported with give_up (the reporter will not re-join) makes it failed, likewise for good. One
// reported with user_stop makes it stopped: no restart counted, its members told to stop; a join
// from a node that was not one of them starts it again as a new run.
//
// Runs: a round whose nodes include one of the previous generation's keeps the job's run id; any
// other round (the first, or a new trnrun invocation after the last one ended) draws a new one.
//
// Recoveries: the newest recovery report (HeartbeatRequest.recovery) of rank 0 of the running
// generation is the job's, kept across generations (that is the point: to see recoveries) and
// dropped when a new run starts. A report whose count differs from the kept one's, and is not
// 0, is a new recovery: a RECOVERED event, and the job is saved. A report with a negative count
// or a negative or non-finite figure is ignored (the heartbeat itself counts).
//
// Heartbeats: a rank's comes from the rank itself (kind WORKER) or from its node's agent, as an
// entry of the node's heartbeat (kind NODE, `ranks`) heard age_ms before the call; both count
// the same for the rank (status, heartbeat count, timeout) and keep its node alive. A rank's
// last-seen time never moves backwards.
//
// Finished jobs (completed, failed, or forming with nobody waiting since their generation ended)
// are removed job_retention after they finished, and beyond max_finished_jobs the oldest go
// first; a new job that finds max_jobs held removes the oldest finished one to make room.
//
// Job tokens: with a job_token_key (the admin token), every job has a token from its creation on,
// the same for all its nodes, generations and runs, and for a coordinator restarted from its
// state (tokens.h); join replies carry it. job_of_token() tells the gRPC layer whose a token is.
// A removed job's token is no one's: a later job of the same id gets a new one.
//
// Locking: one reader-writer lock over the registry, and a stripe lock per node (by node rank).
// Heartbeats, the hot path (a 100,000-rank job sends thousands a second), take the registry lock
// shared and the stripe of the node they write, so heartbeats of different nodes run on every
// core at once; everything else (rendezvous, store, status, tick) takes it exclusively. Under the
// shared lock a heartbeat writes only its node's state (node_seen, node_unknown, its ranks'
// workers) and, for rank 0, the job's recovery figures while their count stays the same (under
// rank 0's node's stripe). A new recovery count (an event and a save) retakes the lock
// exclusively to record it.
//
// Node ranks: a node that ran in the last generation keeps its node rank when the new round has
// room for it (workers recovering in place keep their ranks); the other nodes take the free ranks
// in node_id order (byte-wise), so a first round follows node_id order. Rank offsets are the prefix
// sums of nproc in that order.
#pragma once

#include <absl/synchronization/mutex.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "collectives/core/deadline.h"
#include "launcher/server/status.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

namespace v1 = ::trn::coordinator::v1;

struct Limits {
  size_t max_key_bytes = 4096;
  size_t max_value_bytes = 1 << 20;
  size_t max_keys_per_job = 100000;
  size_t max_kv_bytes_per_job = 256u << 20;
  int max_nodes = 100000;
  int max_nproc = 4096;
  int64_t max_wait_ms = 24LL * 3600 * 1000;
  size_t max_jobs = 10000;
  size_t checkpoints_kept = 50;  // committed checkpoints listed (with shards) per job
};

struct RegistryOptions {
  Duration heartbeat_timeout = std::chrono::seconds(30);
  Limits limits;
  // Called with the changed job's whole state after every change that must survive a restart (a
  // generation started or ended, a checkpoint committed, a node finished), and with its id when
  // it is removed, under the registry lock, so records are written in order. Key-value changes
  // are saved by tick() within ~0.2 s.
  std::function<void(const v1::LogRecord&)> persist;
  Duration job_retention = std::chrono::hours(1);
  size_t max_finished_jobs = 1000;
  std::function<Clock::time_point()> now = [] { return Clock::now(); };
  // Wall-clock milliseconds since the epoch: when jobs finished, across restarts.
  std::function<int64_t()> unix_ms;
  // The coordinator's admin token, from which each job's token is derived (tokens.h); empty: jobs
  // get no token (the coordinator authenticates nobody).
  std::string job_token_key;
};

template <typename T>
using Done = std::function<void(const Status&, T)>;

struct RegistryGauges {
  int64_t jobs = 0, members = 0, heartbeats = 0, restarts = 0, waiters = 0;
  double heartbeat_timeout_s = 0;
  struct JobGauge {
    std::string job_id;
    int64_t generation = 0, members = 0, restarts = 0, last_committed_step = -1;
    std::string state;
    // Seconds since the longest-silent unfinished member node of a running generation was last
    // heard from (since the restore, after a restart); -1 when the job is not running.
    double heartbeat_age_s = -1;
    int64_t last_committed_unix_ms = 0;  // when the newest committed checkpoint committed; 0: none
    // The validation loss rank 0 of the generation last reported (every rank reports the same).
    std::optional<double> val_loss;
    // The job's newest recovery report (Registry: kept across generations); none before one came.
    std::optional<v1::RecoveryStatus> recovery;
    // The MoE figures of rank 0's newest step (a mixture-of-experts model); none for a dense one.
    std::optional<v1::MoeStatus> moe;
  };
  std::vector<JobGauge> per_job;
};

class Registry {
 public:
  explicit Registry(RegistryOptions options);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  void join(const v1::JoinRequest& req, Done<v1::JoinResponse> done);
  Status set(const v1::SetRequest& req);
  void get(const v1::GetRequest& req, Done<std::string> done);
  Status add(const v1::AddRequest& req, int64_t* value);
  Status del(const v1::DeleteRequest& req, bool* deleted);
  void barrier(const v1::BarrierRequest& req, Done<bool> done);
  // datagram_seq: a NODE heartbeat that came as a datagram, with its sequence number (> 0); one
  // not newer than the node's last in this generation fails with kFailedPrecondition and
  // changes nothing. 0: a gRPC call, no sequence.
  Status heartbeat(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* reply, uint64_t datagram_seq = 0);
  Status report_failure(const v1::ReportFailureRequest& req, v1::ReportFailureResponse* reply);
  Status finish(const v1::FinishRequest& req, v1::FinishResponse* reply);
  Status report_shard(const v1::ReportShardRequest& req, v1::ReportShardResponse* reply);
  // The summary and a page of ranks of one job, or of every job (GetStatusRequest says which).
  Status status(const v1::GetStatusRequest& req, v1::GetStatusResponse* reply);
  Status status(const std::string& job_id, v1::GetStatusResponse* reply);  // the first page

  // Events of one job (or all, job_id empty): fn is called under the registry lock, in sequence
  // order, and must not call back in; it returns false to unsubscribe. With replay, the recent
  // events the registry still holds come first.
  void subscribe(const std::string& job_id, bool replay, std::function<bool(const v1::Event&)> fn);

  void tick();
  // Saves the jobs whose key-value changes tick() has not saved yet.
  void flush();
  // Ends every waiting call and event subscription with UNAVAILABLE and refuses new waits
  // (shutdown, or a replica that lost its leadership; the subscriber gets an event of seq -1).
  void close();
  // Accepts waits again after close() (a replica elected leader again).
  void reopen();
  v1::Snapshot snapshot();
  // Replaces every job with the snapshot's; a usage error, changing nothing, when a job in it is
  // invalid (validate_saved_job).
  void restore(const v1::Snapshot& snap);
  RegistryGauges gauges();
  Duration heartbeat_timeout() const { return options_.heartbeat_timeout; }
  // The job whose token `token` is, or nullopt when it is no job's (or the job was removed).
  std::optional<std::string> job_of_token(const std::string& token);
  // The job's token ("" when the coordinator requires none), or nullopt for an unknown job.
  std::optional<std::string> job_token(const std::string& job_id);

  struct Job;

 private:
  using Fired = std::vector<std::function<void()>>;
  static void run(Fired& fired);

  Job* find_job(const std::string& id);
  Status check_generation(const std::string& job_id, int64_t generation, Job** job);
  void try_complete_round(Job& job, Fired& fired);
  void end_generation(Job& job, const std::string& cause, Fired& fired);
  void stop_job(Job& job, const std::string& cause, Fired& fired);
  // True when a member node of the running generation has not been heard from for a third of
  // the heartbeat timeout (or not since a restart): a joining node may be its replacement.
  bool member_silent(const Job& job, Clock::time_point now) const;
  // Forgets the generation's members, workers, store and checkpoint collection; fails its
  // waiting store and barrier calls with `aborted`.
  void clear_generation(Job& job, const Status& aborted, Fired& fired);
  void expire_waits(Job& job, Clock::time_point now, Fired& fired);
  void check_heartbeats(Job& job, Clock::time_point now, Fired& fired);
  // One rank's heartbeat, from the rank itself or forwarded by its node's agent.
  struct RankBeat {
    int rank;
    int64_t pid, step;
    double loss, tokens_per_s;
    const v1::Coordinates* coordinates;  // null: none reported
    int beats;                           // heartbeats it stands for
    std::optional<double> val_loss;      // none: keep the one recorded
    const v1::RecoveryStatus* recovery;  // null: none reported
    const v1::MoeStatus* moe;            // null: none reported (keep the one recorded)
  };
  static Status validate_coordinates(int rank, const v1::Coordinates* c);
  // Both run under the shared lock; they take the node's stripe. A rank-0 report of a new
  // recovery count is left to the caller (*new_recovery, record_rank's true), to record with
  // record_recovery under the exclusive lock.
  Status node_heartbeat(Job& job, const v1::HeartbeatRequest& req, Clock::time_point now, uint64_t datagram_seq,
                        const v1::RecoveryStatus** new_recovery);
  bool record_rank(Job& job, const RankBeat& beat, const std::string& host, Clock::time_point at);
  // Rank 0's recovery report: kept as the job's; a new count is a RECOVERED event.
  void record_recovery(Job& job, const v1::RecoveryStatus& r);
  void emit(Job& job, v1::Event::Kind kind, const std::string& detail, int64_t step = -1);
  void persist_job(Job& job);
  // Gives a job without a token one (a fresh nonce), or derives the token of a restored one, and
  // indexes it. Nothing without options_.job_token_key.
  void ensure_token(Job& job);
  void remove_job(const std::string& id, const char* why);
  void expire_jobs(bool need_room);
  bool finished(const Job& job) const;
  // Keeps finished_ in step with the job's state; call after any change to it.
  void reindex(Job& job);
  int64_t wall_ms() const;
  v1::Snapshot snapshot_locked();
  struct StatusView {
    int rank_start = 0, max_ranks = 0;  // max_ranks < 0: no lists
    int64_t late_ms = 0, stuck_ms = 0, dead_ms = 0;
    int max_attention = 0;
    bool checkpoint_shards = false;
  };
  // Fills the summary, and lists at most view.max_ranks ranks from view.rank_start (and their
  // nodes); returns how many it listed.
  int fill_status(const Job& job, const StatusView& view, v1::JobStatus* out);
  // The stripe of one node's heartbeat state.
  std::mutex& stripe(int node) { return stripes_[static_cast<size_t>(node) % stripes_.size()].m; }

  // absl::Mutex (writers are not starved by a stream of readers) as std::lock_guard and
  // std::shared_lock take it. Under ThreadSanitizer it is std::shared_mutex instead: Debian's
  // libabsl is not built with TSan, which then cannot see what the lock orders and reports every
  // access it guards as a race. The locking protocol TSan checks is the same.
#if defined(TRN_TSAN)  // set by CMakeLists.txt for TRN_SANITIZE=thread, with gcc or clang
  using RwLock = std::shared_mutex;
#else
  struct RwLock {
    absl::Mutex m;
    void lock() { m.Lock(); }
    void unlock() { m.Unlock(); }
    void lock_shared() { m.ReaderLock(); }
    void unlock_shared() { m.ReaderUnlock(); }
  };
#endif

  RegistryOptions options_;
  RwLock mu_;
  struct alignas(64) Stripe {  // one cache line each: neighbouring nodes do not share one
    std::mutex m;
  };
  std::array<Stripe, 64> stripes_;
  std::map<std::string, std::unique_ptr<Job>> jobs_;
  std::unordered_map<std::string, std::string> job_tokens_;  // token_digest(token) -> job id
  std::set<std::pair<int64_t, std::string>> finished_;  // (ended_unix_ms, id), oldest first
  std::deque<v1::Event> recent_events_;
  int64_t next_seq_ = 1;
  struct Subscriber {
    std::string job_id;
    std::function<bool(const v1::Event&)> fn;
  };
  std::map<int, Subscriber> subscribers_;
  int next_subscriber_ = 1;
  bool closed_ = false;
  std::set<std::string> kv_dirty_;  // jobs with key-value changes not saved yet
  Clock::time_point last_kv_save_{};
  Clock::time_point last_expiry_{};
  Clock::time_point last_heartbeat_check_{};
  std::atomic<int64_t> heartbeats_total_{0};
  uint64_t next_waiter_ = 1;
};

}  // namespace trn::control
