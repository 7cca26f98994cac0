// The PointToPoint the fabric hands out. Internal to collectives/fabric.
//
// The transport keeps the caller's side: posting (checked arguments, then the router, which
// hands each operation to its channel: router.h), progress, waiting with deadlines and the
// waiter hand-off (waiters.h), and abort. The protocols live in the channels: libfabric's
// pieces, queues and registration (fabric_channel.h), rails and striping (rails_channel.h), the
// shared-memory rings to peers on this host (ring_channel.h); the peer watch notices lost peers
// (peer_watch.h).
//
// Locking: one mutex (mu_) guards every libfabric call and all state of the router, its
// channels and the waiters, so endpoints are opened FI_THREAD_DOMAIN. It is never held while a
// thread sleeps: waiters drop it, then sleep in epoll on the completion queues' fds and an
// eventfd that abort() writes, or on a condition variable (waiters.h).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/router.h"
#include "collectives/fabric/waiters.h"

namespace trn::fabric {

class Transport : public PointToPoint, public std::enable_shared_from_this<Transport> {
 public:
  // segments: the ring segments peers' rings point into (this rank's and the peers').
  // rails: the endpoints of rails 1.. (main is rail 0).
  Transport(int rank, int size, const Options& opts, std::unique_ptr<Endpoint> main,
            std::unique_ptr<Endpoint> shm, std::vector<Peer> peers, std::vector<RingSegment> segments = {},
            Liveness liveness = {}, std::vector<std::unique_ptr<Endpoint>> rails = {});
  ~Transport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override;
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) override;
  void progress() override;
  void abort(const std::string& reason) override;
  bool aborted() const override { return aborted_.load(std::memory_order_acquire); }
  std::string describe() const override { return router_.describe(); }
  int host_of(int peer) const override { return router_.host_of(peer); }

  // Control traffic (the connect handshake): a wire tag with the control bit set.
  RequestPtr post_control(bool send, int peer, uint64_t wire_tag, void* buf, size_t len);

  // For Request.
  bool test(Op& op);
  void wait(Op& op, Deadline deadline);

  // Registrations made so far (tests of the cache).
  uint64_t registrations() const;

 private:
  RequestPtr post(bool send, int peer, uint64_t wire_tag, char* buf, size_t len);
  void teardown_locked();
  Error aborted_error_now() const;
  Error timeout(const Op& op) const;
  enum class Sleep { kOnFds, kNotYet, kNap };
  Sleep how_to_sleep_locked();
  void sleep_on_fds(Deadline deadline);

  const int rank_, size_;
  const Options opts_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
  mutable std::mutex mu_;
  Waiters waiters_;  // before router_: the router announces completions to it
  Router router_;
};

}  // namespace trn::fabric
