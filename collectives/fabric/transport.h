// The PointToPoint the fabric hands out: per-peer routing over one or two endpoints (main and
// shm) and trn's shared-memory rings, splitting into pieces, queueing posts the provider refuses
// for now (-FI_EAGAIN), completion handling, waiting with deadlines, and abort. Internal to
// collectives/fabric.
//
// Peers on this host that the shm provider reaches also get a pair of rings (shm_ring.h). Then
// every message to such a peer is matched through its ring: one of up to Options::ring_eager
// bytes travels in it. A longer one sends only a "pull" record there ({length, sequence,
// address}); once the record matched its receive, the receiver copies the bytes straight from the
// sender's memory with process_vm_readv and writes an "ack" record ({sequence}) into its own ring,
// which completes the send. Where connect found that the peer cannot read this rank's memory
// (another pid namespace, ptrace restrictions), a "long" record ({length, sequence}) goes instead
// and the bytes take libfabric's shm single-copy path under a tag of their own (wire::bulk).
//
// Only that fallback calls into libfabric's shm provider for data. The pull path has no lock a
// dying peer could hold: a rank killed mid-message makes process_vm_readv fail, or leaves an ack
// unwritten until the peer's exit is noticed (progress polls peers' pidfds every 10 ms). A rank
// that aborts marks its rings closed first; a receiver that sees that after pulling fails the
// receive, since the bytes may have changed under it.
//
// Locking: one mutex (mu_) guards every libfabric call and all state, so endpoints are opened
// FI_THREAD_DOMAIN. It is never held while a thread sleeps: waiters drop it, then sleep in
// epoll on the completion queues' fds and an eventfd that abort() writes.
//
// Several threads may wait at once (each communicator has its own engine thread). Only one of
// them sleeps in epoll (the leader); the others sleep on a condition variable that every
// progress which completed an operation notifies, and the leader on waking hands its place to a
// follower; a progress that completes something while the leader sleeps writes an eventfd in
// its epoll set. Otherwise a thread could sleep in epoll on completions another thread already
// read from the queue, and wake only at the next unrelated event.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <sys/socket.h>

#include "collectives/core/error.h"
#include "collectives/fabric/endpoint.h"
#include "collectives/fabric/fabric.h"
#include "collectives/fabric/shm_ring.h"

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
  // What the op is for: the caller's, or the peer watch's own (transport_watch.cc): a standing
  // receive for loss notices, a notice. A lost peer fails only the caller's.
  enum class Role : uint8_t { kUser, kWatch, kNotice };
  Role role = Role::kUser;
  bool send = false;
  bool ring_eager = false;  // a send whose bytes travel in the peer's ring
  bool unannounced = false;  // a long ring send whose record is not written yet: not complete
  bool pull = false;         // a long ring send the peer reads from buf (kRingPull)
  int peer = 0;
  uint64_t wire_tag = 0;  // piece field clear; wire::bulk(seq) for the bytes of a long ring message
  uint64_t msg_tag = 0;   // the message's own wire tag (what errors name)
  char* buf = nullptr;
  size_t len = 0;
  size_t piece_size = 0;
  uint64_t max_pieces = 0;  // send: exactly this many; receive: at most
  uint64_t posted = 0, inflight = 0;
  size_t bytes = 0;
  bool may_split = false;  // pieces after the first wait for earlier split ops on the same key
  bool on_fabric = false;  // handed to a libfabric endpoint (counted in fabric_ops_)
  bool done = false;
  uint64_t seen_tick = 0;  // the peer watch's probe tick that first saw it pending (0: none yet)
  std::optional<Error> error;
  std::optional<MrCache::Handle> mr;
  std::vector<PieceContext> contexts;  // ring, indexed by piece % size
  // The endpoint and peer address its pieces go through (rails.h: which rail).
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  uint64_t cq_data = 0;  // a send's remote CQ data (a stripe header's kStripeFlag)
  // Striping (rails.h). A striped message's op is a parent: its parts (the header, the stripes)
  // are ops of their own that name it; it completes when the last of them did, and fails with
  // the first that failed. A receive becomes a parent when its first piece was a header.
  std::shared_ptr<Op> parent;
  int parts = 0;           // parts not yet done
  std::optional<Error> part_error;  // the first part's failure
  bool striped = false;    // a parent
  size_t striped_len = 0;  // a striped receive: the bytes the header announced
  std::array<char, 24> header{};  // a striped send's StripeHeader
};

// A record that arrived in a ring before its receive was posted.
struct Unexpected {
  uint64_t tag = 0;
  uint32_t kind = 0;
  std::vector<char> data;
};

struct Peer {
  std::string host;
  int host_index = 0;  // PointToPoint::host_of
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  // Rails (rails.h): the peer's address on each (empty: it is reached through ep alone), its own
  // rail, its near rails (what its messages to other hosts spread over), whether its rails take
  // striped messages, and the sequence number of the next message this rank stripes to it.
  std::vector<fi_addr_t> rail_addr;
  int own_rail = 0;
  std::vector<int> near_rails;
  bool stripes = false;
  uint64_t next_stripe = 0;
  // trn's rings with a peer on this host (shm_ring.h): out is this rank's ring in the peer's
  // segment, in the peer's ring in this rank's segment.
  bool ring = false;
  RingWriter out;
  RingReader in;
  std::deque<std::shared_ptr<Op>> ring_sends;  // records not yet written, in post order
  std::list<std::shared_ptr<Op>> ring_recvs;   // receives waiting for their record, in post order
  std::deque<Unexpected> unexpected;           // records that came before their receive
  uint64_t next_bulk = 0;                      // sequence number of the next long message out
  size_t ring_eager = 0;                       // messages up to this long travel in out
  // Pulls (kRingPull): pull_out when the peer reads this rank's long messages from its memory,
  // pull_in when this rank reads the peer's. pid is the peer's process (checked at connect).
  bool pull_out = false, pull_in = false;
  int pid = 0;
  int pidfd = -1;  // readable once the peer's process ended (pidfd_open); owned by the Transport
  // Acks owed to the peer, not yet written (its ring was full), each with the receive that
  // completes once its ack is out: a rank that saw its receive complete may exit at once.
  std::deque<std::pair<uint64_t, std::shared_ptr<Op>>> acks;
  std::map<uint64_t, std::shared_ptr<Op>> pulled;  // long sends the peer has yet to read, by sequence
  std::string exited;                               // non-empty once the peer's process ended
  // The peer's liveness socket (transport_watch.cc): its address (live_len 0: none), and a
  // connect to it in flight (live_fd) since live_since.
  sockaddr_storage live_addr{};
  socklen_t live_len = 0;
  int live_fd = -1;
  Clock::time_point live_since{};
  Clock::time_point live_answered{};  // when a probe's connect last completed
  // Rails 1..: a probe on each rail's address as well (index r - 1), to tell a rail that stopped
  // carrying traffic from a host that is gone.
  struct RailProbe {
    sockaddr_storage addr{};
    socklen_t len = 0;
    int fd = -1;
    int failed = 0;  // errno of a connect that failed at once
    Clock::time_point since{};
  };
  std::vector<RailProbe> rail_probes;
};

// A listening socket on the main endpoint's address whose only use is that peers can connect to
// it: the kernel completes a connect while the process lives, whether or not it is making
// progress, and refuses it once the process is gone. Port 0 when there is none.
struct Liveness {
  int fd = -1;
  int port = 0;
};
// Opens one on the address of a tcp endpoint (raw: its fi_getname), or on every address of the
// host with its port (rails: one per rail's address); none for other providers.
Liveness open_liveness(const std::string& raw, bool every_address = false);
// A non-blocking stream socket bound to the address of a local endpoint (raw, port 0), so that a
// connect from it leaves through that endpoint's interface (a probe of one rail); -1 when raw is
// not an ip address or the bind fails.
int rail_socket(const std::string& local_raw);
// A peer's liveness address: its endpoint address (raw) with the port it published.
socklen_t liveness_address(const std::string& raw, int port, sockaddr_storage* out);

class Transport : public PointToPoint, public std::enable_shared_from_this<Transport> {
 public:
  // segments: the ring segments peers' rings point into (this rank's and the peers').
  // rails: the endpoints of rails 1.. (main is rail 0), rail_names their names (all of them).
  Transport(int rank, int size, const Options& opts, std::unique_ptr<Endpoint> main,
            std::unique_ptr<Endpoint> shm, std::vector<Peer> peers, std::vector<RingSegment> segments = {},
            Liveness liveness = {}, std::vector<std::unique_ptr<Endpoint>> rails = {},
            std::vector<std::string> rail_names = {});
  ~Transport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override;
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) override;
  void progress() override;
  void abort(const std::string& reason) override;
  bool aborted() const override { return aborted_.load(std::memory_order_acquire); }
  std::string describe() const override { return description_; }
  int host_of(int peer) const override { return peers_.at(peer).host_index; }

  // Control traffic (the connect handshake): a wire tag with the control bit set.
  RequestPtr post_control(bool send, int peer, uint64_t wire_tag, void* buf, size_t len);

  // For Request.
  bool test(Op& op);
  void wait(Op& op, Deadline deadline);

  // Registrations made so far (tests of the cache).
  uint64_t registrations() const;

 private:
  using Key = std::tuple<bool, int, uint64_t, const Endpoint*>;  // send?, peer, wire tag, endpoint

  RequestPtr post(bool send, int peer, uint64_t wire_tag, char* buf, size_t len);
  // Hands op to its peer's endpoint: posts its first pieces, or queues it. retry: on -FI_EAGAIN
  // progress once and try again (not from inside progress_locked).
  void start_fabric_locked(const std::shared_ptr<Op>& op, bool retry);
  void post_ring_send_locked(const std::shared_ptr<Op>& op);
  void post_ring_recv_locked(const std::shared_ptr<Op>& op);
  void flush_ring_locked(Peer& p);  // writes queued records while the ring has room
  void drain_ring_locked(Peer& p);  // matches arrived records against posted receives
  void deliver_locked(const std::shared_ptr<Op>& op, uint32_t kind, const char* data, size_t len);
  void pull_locked(const std::shared_ptr<Op>& op, const RingPull& rec);
  void on_ack_locked(Peer& p, const char* data, size_t len);
  // Notices ring peers whose process ended, at most every kExitCheck.
  void check_exits_locked();
  void peer_exited_locked(int peer);
  std::string exit_text(int peer) const;
  static bool ending(const Peer& p);  // whether p's process ends within 100 ms
  void progress_locked();
  void drain_queues_locked();
  bool post_pieces_locked(Op& op);  // false when the provider said -FI_EAGAIN
  bool can_post(const Op& op) const;
  int endpoint_index(const Op& op) const;
  // Which endpoint and address op's pieces take (rails.h), unless a striped message set them.
  void route_locked(Op& op) const;
  // The rail of a user message with op's peer and tag (rails.h): spread by tag to other hosts,
  // the sender's own rail within its host.
  int rail_of(const Op& op) const;
  bool stripes_to(int peer, const Op& op) const;
  // A striped send: the header and a stripe per rail as parts of op.
  void post_striped_send_locked(const std::shared_ptr<Op>& op);
  // A receive whose first piece brought a header: its stripes' receives.
  void on_stripe_header_locked(const std::shared_ptr<Op>& op, size_t got);
  void start_part_locked(const std::shared_ptr<Op>& parent, bool send, Endpoint* ep, fi_addr_t addr,
                         uint64_t wire_tag, char* buf, size_t len, uint64_t cq_data);
  void part_done_locked(Op& part);
  void settle_parent_locked(Op& parent);  // finishes it once no part is left
  void forget_split_locked(Op& op);
  void on_complete(PieceContext& c, const fi_cq_tagged_entry& e);
  void on_error(Endpoint& ep);
  void finish(Op& op, std::optional<Error> error);

  // The peer watch (transport_watch.cc). A peer is lost when an operation the caller still
  // waits on with it fails because of it (the provider reports the connection broken, a probe to
  // it fails, its process on this host ended, it wrote garbage), or when another rank says so.
  // A lost peer fails every pending and later operation of this transport, with every peer,
  // naming it; and this rank tells others: rank + 1, + 2, + 4, ... by a notice on the fabric,
  // which each rank that hears it forwards the same way, and every same-host ring peer through
  // its ring's closed word. So every rank learns of it within a few hops, whoever it waits for.
  void start_watch_locked();
  void post_watch_locked(int peer);  // the standing receive for probes and notices from peer
  std::shared_ptr<Op> post_internal_locked(Op::Role role, int peer, char* buf, size_t len);
  void suspect_peer_locked(int peer, const std::string& detail);
  // A rail that stopped carrying traffic (detail: to whom, how it was found): every pending and
  // later operation of this transport fails, naming it (a recoverable error: the next
  // generation's connect leaves the rail out). No notices: each rank finds it, or hears of the
  // failure from the job.
  void lose_rail_locked(size_t rail, const std::string& detail);
  void lose_peer_locked(int peer, const std::string& detail, int reporter = -1);
  void watch_locked();  // end of each progress: notices heard, failed probes, new probes
  void probe_locked();
  void check_liveness_locked();  // connects in flight: refused means the peer's process is gone
  void send_notices_locked();
  void flush_notices_locked();  // teardown: lets notices go out (bounded) before closing
  bool user_ops_with(int peer) const;
  void progress_now_locked();  // progress_locked's work, also while aborting
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
  std::vector<std::unique_ptr<Endpoint>> extra_rails_;  // rails 1..
  std::vector<Endpoint*> rails_;                        // every rail: main_ first
  std::vector<std::string> rail_names_;
  std::vector<Endpoint*> endpoints_;                    // main_, shm_ (or null), rails 1..: fabric_ops_'s order
  bool stripe_ = false;                                 // this rank's rails take striped messages
  std::vector<Peer> peers_;
  std::unordered_map<Op*, std::shared_ptr<Op>> active_;  // ops the provider may still touch
  std::map<std::pair<bool, int>, std::list<std::shared_ptr<Op>>> queued_;  // first piece not posted
  size_t queued_count_ = 0;
  std::list<std::shared_ptr<Op>> continuing_;        // split ops with pieces left to post
  std::map<Key, std::list<Op*>> split_order_;        // may-split ops per key, in post order
  std::vector<RingSegment> segments_;
  std::vector<size_t> fabric_ops_;  // per endpoints_: ops not yet let go (their queues need polling)
  std::vector<int> ring_peers_;                      // peers with rings
  Clock::time_point next_exit_check_{};

  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
  int epoll_fd_ = -1;
  int abort_fd_ = -1;
  bool can_sleep_ = false;
  // Waiters (see Locking above), under mu_.
  std::condition_variable woken_;
  bool fd_sleeper_ = false;    // a waiter sleeps in epoll
  int wake_fd_ = -1;           // in the epoll set: written when another thread completed something
  uint64_t fd_announced_ = 0;  // completions_ when wake_fd_ was last written
  int followers_ = 0;          // waiters sleeping on woken_
  uint64_t completions_ = 0;   // operations finished so far
  uint64_t announced_ = 0;     // completions_ when woken_ was last notified

  // The peer watch, under mu_.
  static constexpr size_t kWatchBytes = 256;           // longest probe or notice
  int lost_ = -1;                                      // the first rank lost, or -1
  std::string rail_lost_;                              // the error of a rail lost, or empty
  int lost_reporter_ = -1;                             // who told this rank, or -1
  // A connection that broke is blamed on its peer only after a short grace: a survivor that saw
  // the real loss first, told this rank and exited also breaks its connections, and its notice
  // (naming the rank really lost) may be read just after.
  int suspect_ = -1;
  std::string suspect_detail_;
  Clock::time_point suspect_since_{};
  std::string lost_detail_, lost_text_;                // what happened; the error every op gets
  bool notices_due_ = false;                           // lost, notices not posted yet
  std::vector<std::shared_ptr<Op>> watch_;             // per peer: the standing receive
  Liveness liveness_;                                  // this rank's liveness socket
  std::vector<std::array<char, kWatchBytes>> watch_buf_;
  uint64_t probe_tick_ = 0;                            // probe ticks so far
  std::vector<int> heard_;                             // peers whose standing receive completed
  std::list<std::shared_ptr<Op>> notices_;             // notices in flight
  std::deque<std::string> notice_bytes_;               // their payloads
  Clock::time_point next_probe_{};
};

}  // namespace trn::fabric
