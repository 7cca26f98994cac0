// One job's state inside the Registry (private to launcher/server).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "launcher/server/registry.h"

namespace trn::control {

// kStopped: its user stopped it (trnrun got a signal); a new run may start it again.
enum class JobState { kForming, kRunning, kCompleted, kFailed, kStopped };
const char* to_string(JobState s);

struct Registry::Job {
  std::string id;
  int64_t generation = 0;
  JobState state = JobState::kForming;
  int min_nodes = 0, max_nodes = 0;  // of the current round
  int64_t settle_ms = 0;

  // The running generation.
  std::vector<v1::Member> members;  // by node rank
  std::vector<Clock::time_point> node_seen;
  // By node rank: the sequence number of the newest node heartbeat that came as a datagram
  // (heartbeat_datagram.h); an older or repeated one is refused, so a captured datagram cannot be
  // replayed to keep a dead node alive. 0: none yet in this generation.
  std::vector<uint64_t> node_datagram_seq;
  // Restored from --state-dir: nodes (by rank) and workers not heard from since are shown with
  // an unknown heartbeat age, never as freshly healthy.
  // Bytes, not std::vector<bool>: heartbeats of different nodes write their flags concurrently.
  bool restored = false;
  std::vector<uint8_t> node_unknown;
  std::set<int> finished;
  int world_size = 0;
  std::vector<int> rank_node;  // global rank -> node rank
  // Every rank of the generation, by global rank (index_ranks sizes it). A rank with
  // status.heartbeats() == 0 has not been heard from in this generation; its status holds at most
  // the rank, host and pid of its agent's silent entry, and `seen` then the time its process was
  // last known alive (RankHeartbeat.silent), else nothing. A node's ranks are written only under
  // its heartbeat stripe (Registry::stripe).
  struct Worker {
    v1::WorkerStatus status;
    Clock::time_point seen{};
    // Rank 0 only: the MoE figures of its newest step (HeartbeatRequest.moe), for /metrics. Not
    // part of WorkerStatus: trnctl status pages stay small, and the figures are not saved.
    std::optional<v1::MoeStatus> moe;
  };
  std::vector<Worker> workers;

  // The forming round: nodes waiting for the rendezvous.
  struct JoinWaiter {
    uint64_t id;
    Clock::time_point deadline;
    Done<v1::JoinResponse> done;
  };
  struct Joiner {
    v1::JoinRequest req;
    uint64_t order = 0;
    std::vector<JoinWaiter> waiters;
  };
  std::map<std::string, Joiner> pending;  // by node_id
  uint64_t join_order = 0;
  Clock::time_point last_join{};

  int64_t ended_unix_ms = 0;  // completed, failed, or its generation ended; 0 while running
  std::string failure;        // why it failed (kFailed) or was stopped (kStopped)
  // The run: drawn when a round completes whose nodes include none of last_member_ids (the node
  // ids of the last generation that ran), kept otherwise, so restarts keep it and a new trnrun
  // invocation gets a new one.
  std::string run_id;
  // The job's bearer token (tokens.h): derived from the saved nonce; empty when the coordinator
  // has no admin token. Handed out in join replies only.
  std::string token_nonce;
  std::string token;
  std::set<std::string> last_member_ids;
  // Each node's rank in the last generation that ran: a node that returns keeps it, so workers
  // that recover in place keep their ranks (Registry::try_complete_round).
  std::map<std::string, int> last_node_rank;
  int64_t indexed_ended = -1; // its key in Registry::finished_, -1 when not there

  int restarts = 0;
  std::deque<v1::Restart> history;  // newest last, bounded

  // The newest recovery report of rank 0 of the running generation (in-place recoveries), kept
  // across generations of a run; a new run starts without one. Saved when its count changes.
  std::optional<v1::RecoveryStatus> recovery;
  bool bad_recovery_logged = false;  // an impossible report is logged as a warning once per job

  // Checkpoints: committed (newest last, bounded) and steps still collecting shards.
  std::deque<v1::Checkpoint> committed;
  int64_t last_committed_step = -1;
  std::map<int64_t, std::map<int, v1::Shard>> collecting;

  // Key-value store of the current generation, and waits on it.
  std::unordered_map<std::string, std::string> kv;
  size_t kv_bytes = 0;
  struct GetWaiter {
    uint64_t id;
    int64_t generation;
    Clock::time_point start, deadline;
    Done<std::string> done;
  };
  std::unordered_map<std::string, std::vector<GetWaiter>> get_waiters;  // by key
  std::unordered_map<std::string, int64_t> add_results;  // request_id -> value
  std::deque<std::string> add_order;

  struct BarrierWaiter {
    Clock::time_point start, deadline;
    Done<bool> done;
  };
  struct BarrierState {
    int world_size = 0;
    std::map<int, BarrierWaiter> arrived;  // by rank
  };
  std::map<std::string, BarrierState> barriers;  // by name, current generation

  size_t waiters() const;
  // Recomputes world_size and rank_node from members, and gives every rank an unheard worker.
  void index_ranks();
};

// The job's durable part, as --state-dir keeps it.
void save_job(const Registry::Job& job, v1::Snapshot::Job* out);

}  // namespace trn::control
