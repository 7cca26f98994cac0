// The node-local channel between a worker and the trnrun agent that started it, so that a node
// costs the coordinator one heartbeat RPC per interval however many ranks it runs.
//
// trnrun binds a Unix-domain datagram socket in a private folder ($TMPDIR/trnrun-<pid>-XXXXXX,
// mode 0700) and hands its path to every worker as TRN_AGENT_SOCKET. Each interval the worker's
// heartbeat thread sends one datagram: the serialized HeartbeatRequest (kind WORKER) it would
// otherwise have sent the coordinator. The agent keeps the newest per rank with the time it
// arrived and forwards all of them in its node heartbeat (HeartbeatRequest.ranks, with each
// one's age). When the coordinator says the generation moved on, the agent sends each worker a
// serialized HeartbeatResponse (abort) back to the address the worker's datagrams came from.
//
// Why a datagram socket rather than a shared-memory slot: one sendto() per worker per interval
// (1 Hz by default) is no load; a datagram is atomic (no framing, no torn reads, no seqlock);
// the kernel queues it, so the agent timestamps arrivals itself instead of trusting or polling
// worker clocks; it carries the agent's abort back to the worker on the same socket; and a
// vanished agent shows at once (ENOENT / ECONNREFUSED), which lets the worker fall back to
// heartbeating the coordinator directly. Sends never block: the socket is non-blocking, and a
// full agent queue (EAGAIN) drops that one heartbeat; the next interval sends a fresh one.
// Everything runs on the worker's heartbeat thread, never on its training thread.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <optional>
#include <string>

#include "launcher/client/coordinator_client.h"

namespace trn::control {

// Set by trnrun in each worker's environment: the agent's socket. Read with getenv (it is a
// launcher-to-worker hand-over, not a setting a user chooses).
inline constexpr const char* kAgentSocketEnv = "TRN_AGENT_SOCKET";

// A datagram larger than this is not a heartbeat (the agent drops it).
inline constexpr size_t kMaxAgentDatagram = 16384;

// The reason a resume datagram carries.
inline constexpr const char* kResumeReason = "resume";

// A Unix-domain socket address for path; false when the path does not fit sun_path.
bool unix_address(const std::string& path, sockaddr_un* addr, socklen_t* len);

// The datagrams as bytes. Any process of this user may send to either socket, so each decode
// takes whatever arrived and returns nothing unless it is that datagram, whole and consistent;
// encode writes what decode reads back. tests/fuzz/agent_heartbeat.cc and agent_answer.cc fuzz
// them.
//
// A worker's heartbeat to its agent: a serialized HeartbeatRequest of kind WORKER. Refused
// besides what does not parse: a negative rank, or negative grid coordinates (the coordinator
// refuses a node heartbeat forwarding one whole, which would silence every rank of the node).
struct WorkerHeartbeat {
  std::string job_id;
  int64_t generation = 0;
  WorkerProgress progress;
};
std::string encode_worker_heartbeat(const std::string& job_id, int64_t generation,
                                    const WorkerProgress& progress);
std::optional<WorkerHeartbeat> decode_worker_heartbeat(const char* data, size_t size);

// The agent's answer to a worker: a serialized HeartbeatResponse, an abort (with its reason) or a
// resume (abort false, trnrun --recovery in-place). Refused besides what does not parse: a resume
// to a negative generation, or one whose rank, world size or node rank is impossible.
struct AgentAnswer {
  bool abort = false;
  std::string reason;  // abort: why ("the job's generation moved on" when the agent gave none)
  Resume resume;       // otherwise
};
std::string encode_agent_abort(const std::string& reason, int64_t generation);
std::string encode_agent_resume(const Resume& resume);
std::optional<AgentAnswer> decode_agent_answer(const char* data, size_t size);

// The worker's end.
class AgentChannel {
 public:
  // A non-blocking datagram socket with an autobound (abstract, unnamed) address the agent can
  // answer to. Throws a remote_error when the socket cannot be made or path does not fit.
  explicit AgentChannel(std::string agent_path);
  ~AgentChannel();
  AgentChannel(const AgentChannel&) = delete;
  AgentChannel& operator=(const AgentChannel&) = delete;

  enum class Sent {
    kOk,
    kBusy,  // the agent's queue is full: this heartbeat is dropped
    kGone,  // no agent at the path any more (error() says why)
  };
  Sent send(const std::string& job_id, int64_t generation, const WorkerProgress& progress);
  // Reads the datagrams waiting; returns the reason when the agent said abort. Datagrams from
  // anyone but the agent are ignored. A "resume" (a HeartbeatResponse with abort false: the
  // agent re-joined generation G, trnrun --recovery in-place) is kept for take_resume().
  std::optional<std::string> receive();
  // The newest resume since the last call, if any.
  std::optional<Resume> take_resume();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_;
  sockaddr_un addr_{};
  socklen_t addr_len_ = 0;
  int fd_ = -1;
  std::string error_;
  std::optional<Resume> resume_;
};

}  // namespace trn::control
