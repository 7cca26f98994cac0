// Client of trn-coordinator, used by workers (trn-train), by trnrun's per-node agent and by
// trnctl. Every call has a deadline; transient failures (coordinator restarting, UNAVAILABLE)
// are retried with backoff until that deadline; the coordinator's answers that are the caller's
// fault (INVALID_ARGUMENT, UNAUTHENTICATED) become usage errors at once.
//
// Roles in a job:
//  - a node agent (trnrun, one per node) calls join() to rendezvous with the other nodes and learn
//    its node rank and the global rank offset of its workers; it calls node_heartbeat() while its
//    workers run (carrying their heartbeats), report_failure() when one of them fails, and
//    finish() when they all exited 0;
//  - a worker (TRN_RANK r) heartbeats its progress (Heartbeater: to its trnrun agent when it has
//    one, else heartbeat() straight to the coordinator), uses store() to bootstrap the fabric, and
//    report_shard() for checkpoints.
// A reply with abort=true means the job's generation moved on: the caller stops and re-joins.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/bootstrap/store.h"
#include "collectives/core/deadline.h"
#include "launcher/client/tls_files.h"

namespace trn::coordinator::v1 {
class HeartbeatRequest;
class MoeStatus;
class RecoveryStatus;
}

namespace trn::control {

struct ClientOptions {
  // HOST:PORT, or several separated by commas: the replicas of a coordinator that keeps its state
  // in etcd (trn-coordinator --store). A call that finds its coordinator unavailable, or a standby,
  // moves on to the next address (or straight to the leader a standby names) and retries there.
  std::string address;
  std::string token;          // bearer token, empty for none
  // TLS when either of the first two is set: the coordinator's certificate is verified against
  // tls_ca_file (empty: the system's roots); a certificate it cannot verify fails the first call
  // at once, as a usage error, rather than being retried. The files are loaded and checked when
  // the client is made (launcher/client/tls_files.h): a bad one is a usage error before any call.
  std::string tls_ca_file;    // PEM; empty with no client certificate: plaintext
  std::string tls_cert_file;  // client certificate for mTLS (optional; needs tls_key_file)
  std::string tls_key_file;
  Duration rpc_timeout = std::chrono::seconds(30);  // per call, including retries
  // How long a node heartbeat sent as a datagram waits for its answer before it goes over gRPC
  // (launcher/client/datagram_heartbeats.h). Capped by rpc_timeout.
  Duration heartbeat_datagram_wait = std::chrono::milliseconds(500);
};

// "a:1, b:2" -> {"a:1", "b:2"} (ClientOptions::address), each checked by the one address parser
// (launcher/client/address.h); a usage error naming `what` for an empty entry or a bad address.
std::vector<std::string> split_addresses(const std::string& list, const std::string& what = "coordinator address");

// Checks what a program was given before anything dials: the address (list) by the address
// parser, named address_name ("--coordinator", "TRN_COORDINATOR"), and every TLS file, loaded and
// checked (launcher/client/tls_files.h), named by tls_names. One usage line for the first fault.
// The client's constructor checks the same, in generic words; a program calls this first so the
// line names its flags.
void check_client_options(const ClientOptions& options, const std::string& address_name,
                          const TlsNames& tls_names);

// Options from TRN_COORDINATOR, TRN_TOKEN_FILE and TRN_TLS_CA, TRN_TLS_CERT, TRN_TLS_KEY (what
// trnrun gives its workers), checked by check_client_options under those names; a usage error
// when TRN_COORDINATOR is unset.
ClientOptions options_from_environment();

struct NodeInfo {
  int node_rank = 0;
  std::string node_id;
  std::string host;
  int nproc = 0;
  int rank_offset = 0;
};

struct JoinRequest {
  std::string job_id;
  std::string node_id;  // unique per agent process (e.g. host:pid); a duplicate re-join is idempotent
  std::string host;
  int nproc_per_node = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  Duration settle = std::chrono::milliseconds(500);  // wait after min_nodes for late joiners
  Deadline deadline = Deadline::after(std::chrono::seconds(300));
  // Fill JoinResult::nodes. Every node receiving every member is O(nodes^2) at the rendezvous;
  // large jobs turn it off (rank, offset and world size come regardless).
  bool include_nodes = true;
};

struct JoinResult {
  int64_t generation = 0;
  int node_rank = 0;
  int nnodes = 0;
  int world_size = 0;
  int rank_offset = 0;  // global rank of this node's local rank 0
  std::vector<NodeInfo> nodes;
  // The run this generation belongs to (kept by restarts, new for a new run); empty from a
  // coordinator that predates run ids.
  std::string run_id;
  // The job's bearer token (the same for every node and generation), which authorizes calls on
  // this job only; trnrun gives it to its workers instead of the admin token. Empty from a
  // coordinator that requires no token (or predates job tokens).
  std::string job_token;
};

// A worker's place in the process grid (DESIGN.md: rank = (pp * dp_size + dp) * tp_size + tp).
struct GridCoordinates {
  int dp_rank = 0;
  int tp_rank = 0;
  int pp_rank = 0;
};

// Job-wide figures of the in-place recoveries of a run (trnrun --recovery in-place), as rank 0
// computes them after each recovery; the durations (from the failure being seen), the restored
// step, steps lost and processes replaced are the newest recovery's. trnctl status, trnctl watch
// (a RECOVERED event per new count) and /metrics show what rank 0 of the job reported.
struct RecoveryReport {
  int64_t recoveries = 0;
  double detect_to_generation_s = 0, detect_to_restored_s = 0, detect_to_first_step_s = 0;
  int64_t restored_step = 0, steps_lost = 0, steps_lost_total = 0, replaced = 0;
  double goodput = -1;  // seconds of kept steps / wall seconds since the job started; -1 unknown
};

// RecoveryReport on the wire, and back: a goodput outside 0..1 or not finite goes, and comes
// back, as unknown.
void recovery_to_proto(const RecoveryReport& r, coordinator::v1::RecoveryStatus* out);
RecoveryReport recovery_from_proto(const coordinator::v1::RecoveryStatus& r);

// The MoE figures of one training step (HeartbeatRequest.moe): the balancing loss, per MoE layer
// the busiest expert's tokens over the mean and the experts that took none, and the choices the
// capacity dropped. At most kMaxMoeLayers layers go on the wire: 512 layers of both lists take
// under 7 KB of a heartbeat, well inside an agent datagram (kMaxAgentDatagram, 16 KB), and no
// model trn trains has more than a few hundred layers.
inline constexpr size_t kMaxMoeLayers = 512;
struct MoeReport {
  double aux_loss = 0;
  std::vector<double> max_mean;
  std::vector<int32_t> dead;
  double dropped = 0;
};

// MoeReport on the wire, and back: the first kMaxMoeLayers layers of each list are sent.
void moe_to_proto(const MoeReport& r, coordinator::v1::MoeStatus* out);
MoeReport moe_from_proto(const coordinator::v1::MoeStatus& m);

struct WorkerProgress {
  int rank = 0;
  std::string host;
  int64_t pid = 0;
  int64_t step = 0;
  double loss = 0;
  double tokens_per_s = 0;
  std::optional<GridCoordinates> coordinates = std::nullopt;  // sent when set; trnctl status shows it
  std::optional<double> val_loss = std::nullopt;  // the newest validation loss; sent when set
  std::optional<RecoveryReport> recovery = std::nullopt;  // the newest recovery report; sent when set
  std::optional<MoeReport> moe = std::nullopt;  // the newest step's MoE figures; sent when set
};

// A worker's heartbeat as its node agent forwards it: the progress it reported, how long ago the
// agent heard it, and how many of the worker's heartbeats it stands for (the agent keeps the
// newest of those it heard between two node heartbeats).
// The heartbeat of one worker as it goes on the wire: to the coordinator directly, or to its
// trnrun agent (agent_channel.h), which forwards it.
coordinator::v1::HeartbeatRequest worker_heartbeat_request(const std::string& job_id, int64_t generation,
                                                           const WorkerProgress& p);

// The agent's word that this worker's node joined `generation` (trnrun --recovery in-place): the
// worker goes on there as `rank` of `world_size` on node `node_rank` (world_size 0: unchanged).
struct Resume {
  int64_t generation = 0;
  int rank = 0, world_size = 0, node_rank = 0;
};

struct ForwardedHeartbeat {
  WorkerProgress progress;
  Duration age = Duration::zero();
  int beats = 1;
  bool silent = false;  // RankHeartbeat.silent: progress holds rank and pid only
};

struct HeartbeatReply {
  bool abort = false;       // the generation moved on; stop and re-join
  int64_t generation = 0;   // the job's current generation
  std::string reason;       // why it moved on
  bool stopped = false;     // with abort: the job's user stopped it; do not re-join
};

struct ShardReport {
  int64_t step = 0;
  int rank = 0;
  std::string path;
  uint64_t bytes = 0;
  std::string sha256;  // hex, may be empty
};

class CoordinatorClient {
 public:
  explicit CoordinatorClient(ClientOptions options);
  ~CoordinatorClient();
  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  JoinResult join(const JoinRequest& request);
  HeartbeatReply heartbeat(const std::string& job_id, int64_t generation, const WorkerProgress& progress);
  // The node agent's heartbeat, carrying the heartbeats its workers handed it since the last one
  // (one RPC per node per interval, however many ranks the node runs).
  HeartbeatReply node_heartbeat(const std::string& job_id, int64_t generation, int node_rank,
                                const std::vector<ForwardedHeartbeat>& ranks = {}, const std::string& host = "");
  // A worker of this generation failed: the coordinator starts a new generation. With give_up
  // (the caller will not re-join: no restarts left, or a usage error), the job fails for good.
  // timeout: how long to keep trying (default: the client's rpc_timeout); a worker that lost its
  // peers gives up sooner, since its agent reports its exit anyway.
  void report_failure(const std::string& job_id, int64_t generation, int rank, const std::string& reason,
                      bool give_up = false, std::optional<Duration> timeout = std::nullopt);
  // The user stopped the job on this node (trnrun got a signal): the job is stopped, not failed,
  // and no restart is counted; its other nodes are told to stop.
  void report_stop(const std::string& job_id, int64_t generation, int rank, const std::string& reason);
  // This node's workers all finished successfully.
  void finish(const std::string& job_id, int64_t generation, int node_rank);
  // Returns the last step at which every rank's shard is reported (committed), or -1. Once a
  // report failed because the coordinator could not be reached, later ones make a single short
  // try until one succeeds again: a checkpoint never waits out the full rpc_timeout per report
  // while the coordinator is gone (the report is advisory; the checkpoint on disk is what counts).
  int64_t report_shard(const std::string& job_id, int64_t generation, const ShardReport& shard);
  void barrier(const std::string& job_id, int64_t generation, const std::string& name, int rank,
               int world_size, Deadline deadline);

  // A Store whose keys live in this job and generation only.
  std::unique_ptr<Store> store(const std::string& job_id, int64_t generation);

  struct Impl;
  // The connection, for calls this class does not wrap (trnctl; see launcher/client/rpc.h).
  Impl& impl() { return *impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

// A worker's background heartbeat: sends progress every TRN_HEARTBEAT_INTERVAL; when a reply
// says abort (or the coordinator cannot be reached before TRN_TIMEOUT), calls on_abort once from
// the heartbeat thread. The destructor stops the thread.
//
// Under trnrun (TRN_AGENT_SOCKET set) the progress goes as one datagram per interval to the
// node's agent, which forwards every local rank's in one node heartbeat, and the abort comes back
// from the agent the same way (launcher/client/agent_channel.h). When the agent's socket is gone
// the worker heartbeats the coordinator directly from then on, as it does without trnrun.
// update(), set_coordinates(), set_val_loss(), set_recovery() and set_moe() only take a mutex: the training thread never waits on I/O.
//
// With on_resume (a worker of `trnrun --recovery in-place`), an abort does not end the thread:
// on_abort is called once per generation, heartbeats go on, and when the agent says it re-joined
// generation G (a resume datagram, agent_channel.h) on_resume is called; after set_generation(G)
// heartbeats carry G and the next abort is G's.
class Heartbeater {
 public:
  Heartbeater(CoordinatorClient& client, std::string job_id, int64_t generation, int rank,
              std::function<void(const std::string& reason)> on_abort,
              std::function<void(const Resume&)> on_resume = {});
  ~Heartbeater();
  // Heartbeats from now on are of `rank` in `generation` (an elastic job may renumber ranks).
  void set_generation(int64_t generation, int rank);
  void update(int64_t step, double loss, double tokens_per_s);
  // The newest validation loss, sent with every heartbeat from now on (trnctl status VAL_LOSS).
  void set_val_loss(double val_loss);
  // The newest recovery report (after each in-place recovery; rank 0's is the job's), sent with
  // every heartbeat from now on (trnctl status and watch, /metrics). Only takes the lock.
  void set_recovery(const RecoveryReport& r);
  // The newest step's MoE figures, sent with every heartbeat from now on (/metrics trn_job_moe_*);
  // nullopt: send none. Only takes the lock.
  void set_moe(std::optional<MoeReport> r);
  // The worker's (dp, tp, pp) coordinates, sent with every heartbeat from now on (trnctl status
  // shows them as DP/TP/PP). Call once the layout is known; negative values are refused by the
  // coordinator.
  void set_coordinates(int dp_rank, int tp_rank, int pp_rank);
  // True while heartbeats go to the trnrun agent rather than to the coordinator.
  bool via_agent() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace trn::control
