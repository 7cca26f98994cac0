// The node agent's end of heartbeat datagrams (heartbeat_datagram.h): sends one node heartbeat
// to the coordinator as a datagram and waits a short while for the answer.
//
// CoordinatorClient::node_heartbeat tries this first and falls back to gRPC when it yields
// nothing; the gRPC reply says where the coordinator that answered takes datagrams, so after a
// failover the datagrams follow the new leader. A heartbeat whose datagram arrived but whose
// answer was lost goes again over gRPC and is counted twice in the rank's heartbeat count; its
// effect on liveness is the same.
//
// After kMissesToBackOff datagrams in a row go unanswered (UDP filtered on the way, the
// coordinator's port taken by another program, a standby), the next kBackOffCalls heartbeats go
// straight to gRPC, then datagrams are tried again. Going from one to the other is logged once
// each way.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "collectives/core/deadline.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

class DatagramHeartbeats {
 public:
  static constexpr int kMissesToBackOff = 3;
  static constexpr int kBackOffCalls = 30;
  // The least size of a datagram sent without a MAC; see padded_payload.
  static constexpr size_t kMinUnkeyedRequest = 512;

  // req serialized as a datagram's payload. Without a MAC (keyed false) the coordinator answers
  // only when its answer is no longer than the request, so a short request (a node with no new
  // worker heartbeats) is padded (HeartbeatRequest.padding) to kMinUnkeyedRequest bytes with
  // the header: room for an answer with an abort reason.
  static std::string padded_payload(const coordinator::v1::HeartbeatRequest& req, bool keyed);

  DatagramHeartbeats();
  ~DatagramHeartbeats();
  DatagramHeartbeats(const DatagramHeartbeats&) = delete;
  DatagramHeartbeats& operator=(const DatagramHeartbeats&) = delete;

  // Where the coordinator that answered at grpc_address (HOST:PORT) takes datagrams for job_id:
  // udp_port on that host (0: it takes none), in its epoch, MACed with key (the job's token;
  // empty: none).
  void configure(const std::string& job_id, const std::string& key, const std::string& grpc_address,
                 int udp_port, uint64_t epoch);
  // After a gRPC heartbeat of job_id answered by grpc_address: configure() again with the key
  // the join gave, so datagrams follow a new leader (or stop, when it takes none).
  void follow(const std::string& job_id, const std::string& grpc_address, int udp_port, uint64_t epoch);

  // The coordinator's answer to req sent as a datagram, or nullopt: datagrams are not set up for
  // req's job, req is too large for one, backing off, or no valid answer came within `wait`.
  // *sent: the sequence number of the datagram sent (0: none was), which the gRPC heartbeat sent
  // in its place carries (HeartbeatRequest.datagram_seq).
  std::optional<coordinator::v1::HeartbeatResponse> exchange(const coordinator::v1::HeartbeatRequest& req,
                                                             Duration wait, uint64_t* sent = nullptr);

 private:
  void configure_locked(const std::string& job_id, const std::string& key, const std::string& grpc_address,
                        int udp_port, uint64_t epoch);

  std::mutex mu_;  // one exchange at a time (the agent heartbeats from one thread)
  int fd_ = -1;
  std::string job_id_, key_, target_;  // target_: "HOST:UDP_PORT", for messages
  sockaddr_storage to_{};
  socklen_t to_len_ = 0;
  uint64_t seq_ = 0, epoch_ = 0;
  int misses_ = 0, skip_ = 0;
  bool resolve_again_ = false;  // backing off: the host's address may have changed (a new pod)
  bool backing_off_logged_ = false;
};

}  // namespace trn::control
