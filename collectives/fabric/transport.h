// The PointToPoint the fabric hands out: per-peer routing over one or two endpoints (main and
// shm), splitting into pieces, queueing posts the provider refuses for now (-FI_EAGAIN),
// completion handling, waiting with deadlines, and abort. Internal to collectives/fabric.
//
// Locking: one mutex (mu_) guards every libfabric call and all state, so endpoints are opened
// FI_THREAD_DOMAIN. It is never held while a thread sleeps: waiters drop it, then sleep in
// epoll on the completion queues' fds and an eventfd that abort() writes.
#pragma once

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"

namespace trn::fabric {

struct Op;

// The context libfabric hands back with each completion: one per posted piece.
struct PieceContext {
  fi_context2 ctx;  // first: providers with FI_CONTEXT/FI_CONTEXT2 mode use it as scratch
  Op* op = nullptr;
  uint64_t index = 0;
  size_t len = 0;
};

struct Op {
  bool send = false;
  int peer = 0;
  uint64_t wire_tag = 0;  // piece field clear
  char* buf = nullptr;
  size_t len = 0;
  size_t piece_size = 0;
  uint64_t max_pieces = 0;  // send: exactly this many; receive: at most
  uint64_t posted = 0, inflight = 0;
  size_t bytes = 0;
  bool may_split = false;  // pieces after the first wait for earlier split ops on the same key
  bool done = false;
  std::optional<Error> error;
  std::optional<MrCache::Handle> mr;
  std::vector<PieceContext> contexts;  // ring, indexed by piece % size
};

struct Peer {
  std::string host;
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  std::string failure;  // non-empty once the provider reported this peer broken
};

class Transport : public PointToPoint, public std::enable_shared_from_this<Transport> {
 public:
  Transport(int rank, int size, const Options& opts, std::unique_ptr<Endpoint> main,
            std::unique_ptr<Endpoint> shm, std::vector<Peer> peers);
  ~Transport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override;
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) override;
  void progress() override;
  void abort(const std::string& reason) override;
  bool aborted() const override { return aborted_.load(std::memory_order_acquire); }
  std::string describe() const override { return description_; }

  // Control traffic (the connect handshake): a wire tag with the control bit set.
  RequestPtr post_control(bool send, int peer, uint64_t wire_tag, void* buf, size_t len);

  // For Request.
  bool test(Op& op);
  void wait(Op& op, Deadline deadline);

  // Registrations made so far (tests of the cache).
  uint64_t registrations() const;

 private:
  using Key = std::tuple<bool, int, uint64_t>;  // send?, peer, wire tag

  RequestPtr post(bool send, int peer, uint64_t wire_tag, char* buf, size_t len);
  void progress_locked();
  void drain_queues_locked();
  bool post_pieces_locked(Op& op);  // false when the provider said -FI_EAGAIN
  bool can_post(const Op& op) const;
  void on_complete(PieceContext& c, size_t got);
  void on_error(Endpoint& ep);
  void finish(Op& op, std::optional<Error> error);
  void fail_peer(int peer, const std::string& what);
  void teardown_locked();
  Error aborted_error_now() const;
  Error timeout(const Op& op) const;
  std::string peer_name(int peer) const;
  enum class Sleep { kOnFds, kNotYet, kNap };
  Sleep how_to_sleep_locked();

  const int rank_, size_;
  const Options opts_;
  std::string description_;

  mutable std::mutex mu_;
  std::unique_ptr<Endpoint> main_, shm_;
  std::vector<Peer> peers_;
  std::unordered_map<Op*, std::shared_ptr<Op>> active_;  // ops the provider may still touch
  std::map<std::pair<bool, int>, std::list<std::shared_ptr<Op>>> queued_;  // first piece not posted
  size_t queued_count_ = 0;
  std::list<std::shared_ptr<Op>> continuing_;        // split ops with pieces left to post
  std::map<Key, std::list<Op*>> split_order_;        // may-split ops per key, in post order

  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
  int epoll_fd_ = -1;
  int abort_fd_ = -1;
  bool can_sleep_ = false;
};

}  // namespace trn::fabric
