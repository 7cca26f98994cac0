// The agent's end of the worker-to-agent heartbeat channel (launcher/client/agent_channel.h):
// a Unix datagram socket the node's workers send their heartbeats to, and the table of what
// each local rank last reported and when it arrived. The agent's heartbeat thread take()s the
// table once per interval and sends it as one node heartbeat.
//
// Invariant: take() returns a rank only when a heartbeat of it arrived since the previous
// take(), with the time since the newest one arrived. A rank whose process hangs or whose
// heartbeat thread stops is simply absent, so the coordinator sees its age grow and calls it
// late, stuck and finally dead exactly as when it heartbeats directly; the node being alive
// never stands in for its ranks.
//
// It also keeps, per rank of this node, the address the newest datagram came from and when it
// arrived, whatever its generation: a worker that survives a failure under --recovery in-place
// goes on heartbeating in its old generation until the agent's resume reaches it (tell_resume),
// and the agent judges a worker hung by how long it has been silent (silent_for).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "launcher/client/agent_channel.h"
#include "launcher/client/coordinator_client.h"

namespace trn::launch {

// What the relay knows, without its socket: each local rank's newest heartbeat and the address
// its datagrams come from, and the resumes still owed. HeartbeatRelay keeps one under its lock
// and does the I/O; tests/fuzz/agent_heartbeat.cc runs one with no socket at all. Times are the
// caller's, so it reads no clock. The methods are HeartbeatRelay's (below says what they do).
class HeartbeatTable {
 public:
  // Where a worker's datagrams came from (its autobound address): its answers go there.
  struct Address {
    sockaddr_un addr{};
    socklen_t len = 0;
  };
  // An answer to send: a serialized HeartbeatResponse (agent_channel.h), for rank, to its address.
  struct Send {
    int rank = 0;
    Address to;
    std::string bytes;
  };

  explicit HeartbeatTable(std::string job_id) : job_id_(std::move(job_id)) {}

  // A datagram that arrived from `from` at `now`. Counts when it is a heartbeat of this job
  // (decode_worker_heartbeat) from one of the node's ranks in the expected generation; one of
  // another generation only moves that rank's address (never back to an older generation's)
  // and its silence; anything else is ignored. Returns whether it counted.
  bool receive(const char* data, size_t size, const Address& from, Clock::time_point now);
  void ignore() { ++ignored_; }  // a datagram too long to be read

  void expect(int64_t generation, int first_rank, int count);
  void started(int rank, int64_t pid, Clock::time_point at);
  void exited(int rank) { processes_.erase(rank); }
  std::vector<control::ForwardedHeartbeat> take(Clock::time_point now);
  std::vector<Send> abort(const std::string& reason, int64_t generation) const;
  // The resumes to send now (to the ranks with an address); every rank of ranks that is this
  // node's and not heard in generation yet is pending from here on.
  std::vector<Send> resume(int64_t generation, const std::vector<int>& ranks, int world_size, int node_rank);
  std::vector<Send> resend_resume() const;
  const std::vector<int>& resume_pending() const { return resume_pending_; }
  std::optional<Duration> silent_for(int rank, Clock::time_point now) const;
  int64_t ignored() const { return ignored_; }
  int64_t generation() const { return generation_; }
  int first_rank() const { return first_rank_; }
  int count() const { return count_; }

 private:
  std::optional<Send> send_to(int rank, std::string bytes) const;

  struct Rank {
    control::WorkerProgress progress;
    Clock::time_point heard{};
    int beats = 0;  // since the last take(); 0: nothing new
  };
  std::string job_id_;
  int64_t generation_ = -1;
  int first_rank_ = 0, count_ = 0;
  std::map<int, Rank> ranks_;  // by global rank, of the expected generation
  // Where each rank's newest datagram (of this job, any generation) came from, by global rank.
  struct Peer {
    Address from;
    int64_t generation = -1;  // of that datagram: an older generation's never moves the address back
    Clock::time_point heard{};
  };
  std::map<int, Peer> peers_;
  // The process running each rank of the expected generation and when it started (started()).
  struct Process {
    int64_t pid = 0;
    Clock::time_point at{};
  };
  std::map<int, Process> processes_;
  bool heartbeating_ = false;  // a worker of this job has heartbeated: the program does
  int64_t resume_generation_ = -1;
  std::vector<int> resume_pending_;          // ranks told to resume in resume_generation_, not heard in it
  std::map<int, std::string> resume_bytes_;  // by rank: each carries the rank it resumes as
  int64_t ignored_ = 0;
};

class HeartbeatRelay {
 public:
  // Binds DIR/heartbeats.sock and starts the thread that receives. DIR is run_dir (trnrun's
  // private folder, shared with its embedded coordinator) or, when that is empty or too long for
  // a socket path, a new $TMPDIR/trnrun-<pid>-XXXXXX; either is mode 0700, so only this user can
  // send to it, and remove_stale_run_dirs clears one a SIGKILLed trnrun left. Throws a
  // remote_error when it cannot.
  explicit HeartbeatRelay(std::string job_id, const std::string& run_dir = "");
  ~HeartbeatRelay();  // stops the thread, removes the socket and the folder it made
  HeartbeatRelay(const HeartbeatRelay&) = delete;
  HeartbeatRelay& operator=(const HeartbeatRelay&) = delete;

  const std::string& socket_path() const { return path_; }

  // From now on, heartbeats count only from this generation's ranks first..first+count-1; the
  // heartbeats heard before are forgotten. The workers' addresses are kept by local rank: when
  // the node's ranks moved (an elastic job's new generation), each address moves with its local
  // rank, so survivors kept in place can still be told to resume; a different count forgets them.
  void expect(int64_t generation, int first_rank, int count);
  // The process now running rank (of the expected generation), started at `at`: a new worker,
  // a replacement, or one kept through an in-place recovery.
  void started(int rank, int64_t pid, Clock::time_point at);
  // Rank's process exited: no silent entry for it from now on.
  void exited(int rank);
  // The ranks heard from since the last take(): the newest heartbeat of each, how long ago it
  // arrived, and how many arrived. Once any worker of the job has heartbeated (so the program
  // does), also every rank with a process (started()) not heard in the expected generation yet,
  // as a silent entry (RankHeartbeat.silent) aged from its last heartbeat of any generation or
  // else its start: the coordinator then judges a worker that stopped before its first heartbeat
  // in the generation, where it would otherwise judge only the node.
  std::vector<control::ForwardedHeartbeat> take();
  // Tells every worker it heard from in the expected generation, and every one told to resume in
  // it that has not heartbeated in it yet, to abort, with reason: a serialized HeartbeatResponse
  // with abort true, generation and reason.
  void tell_abort(const std::string& reason, int64_t generation);
  // Tells the workers of ranks (this node's, kept running through a failure) to go on in
  // generation with the same rank: a serialized HeartbeatResponse with abort false, generation
  // and reason "resume", sent to the newest address each rank's datagrams came from. Each rank
  // stays pending, told again by every resend_resume(), until its first heartbeat of generation
  // arrives (a worker busy failing its step may not read the first). A rank never heard from is
  // pending but cannot be told. Returns how many were sent.
  // world_size and node_rank go in the resume too (the ranks are the new generation's).
  int tell_resume(int64_t generation, const std::vector<int>& ranks, int world_size = 0, int node_rank = 0);
  // Tells the pending ranks again; returns how many are still pending.
  int resend_resume();
  // The ranks told to resume that have not heartbeated in its generation yet.
  std::vector<int> resume_pending() const;
  // How long since the newest datagram of this job from rank arrived, whatever its generation;
  // nullopt when none has since the rank range last changed.
  std::optional<Duration> silent_for(int rank) const;
  // Datagrams ignored: malformed, or of another job, generation or rank.
  int64_t ignored() const;

  // The resume datagram's reason.
  static constexpr const char* kResumeReason = control::kResumeReason;

 private:
  void receive_loop();
  // Sends one answer; false (logged at debug) when it cannot.
  bool send(const HeartbeatTable::Send& s, const char* what);

  std::string own_dir_;  // the folder it made, removed with it; empty when it used run_dir
  std::string path_;
  int fd_ = -1, wake_fd_ = -1;
  std::thread thread_;
  mutable std::mutex mu_;
  HeartbeatTable table_;
};

}  // namespace trn::launch
