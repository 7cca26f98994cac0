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
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launcher/client/coordinator_client.h"

namespace trn::launch {

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

  // From now on, heartbeats count only from this generation's ranks first..first+count-1;
  // anything heard before is forgotten.
  void expect(int64_t generation, int first_rank, int count);
  // The ranks heard from since the last take(): the newest heartbeat of each, how long ago it
  // arrived, and how many arrived.
  std::vector<control::ForwardedHeartbeat> take();
  // Tells every worker of the expected generation it has heard from to abort, with reason.
  void tell_abort(const std::string& reason, int64_t generation);
  // Datagrams ignored: malformed, or of another job, generation or rank.
  int64_t ignored() const { return ignored_; }

 private:
  void receive_loop();
  void handle(const char* data, size_t size, const sockaddr_un& from, socklen_t from_len);

  struct Rank {
    control::WorkerProgress progress;
    Clock::time_point heard{};
    int beats = 0;  // since the last take(); 0: nothing new
    sockaddr_un from{};
    socklen_t from_len = 0;
  };

  std::string job_id_;
  std::string own_dir_;  // the folder it made, removed with it; empty when it used run_dir
  std::string path_;
  int fd_ = -1, wake_fd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  int64_t generation_ = -1;
  int first_rank_ = 0, count_ = 0;
  std::map<int, Rank> ranks_;  // by global rank, of the expected generation
  std::atomic<int64_t> ignored_{0};
};

}  // namespace trn::launch
