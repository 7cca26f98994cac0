// A small etcd v3 client (gRPC) for the coordinator: it keeps its state in etcd and elects a
// leader among replicas through a lease. Only what that needs: single keys, prefixes, two
// transactions (create-if-absent, and writes fenced by the leader key), leases and a lease
// keeper. The messages are trn's own subset of etcd's API (proto/etcd/).
//
// Endpoints and failover: one gRPC channel per endpoint. A call goes to the endpoint that last
// answered; when it is unreachable or has no raft leader (gRPC UNAVAILABLE), the call moves on
// to the next endpoint, round and round with a short backoff, until one answers or the call's
// deadline (Options::timeout, default 2 s) passes. Every KV and lease call asks etcd to refuse
// it at once when the member knows no leader (etcd's "hasleader" metadata), so a call never
// waits for etcd's own request timeout (7 s by default). A call made while there is no leader
// keeps retrying until its deadline, since an election (about a second) may end in time: a
// cluster without quorum fails each call at its deadline, never later.
//
// Errors: no call throws; each returns a Status (launcher/server/status.h) whose message is one
// line naming the operation and, per endpoint tried, what went wrong, e.g.
//   "put /trn/leader failed: etcd 127.0.0.1:2379: no leader (the etcd cluster lost quorum)".
// Codes: kUnavailable (no endpoint could serve it: unreachable, no leader, quorum lost),
// kDeadlineExceeded (no answer within the deadline), kNotFound (the lease does not exist),
// kInvalidArgument (etcd refused the request: too large, same key twice in a txn, ...),
// kResourceExhausted (etcd's database is full), kFailedPrecondition (anything else).
//
// A failed write may still have taken effect unless every failure proves it did not (not
// connected, no leader, refused by etcd); the message then ends "(the write may or may not
// have taken effect)". Writes are retried on the next endpoint only after UNAVAILABLE; each
// write here is idempotent in effect (put, delete, fenced txn), except that a retried grant()
// can leave an unused lease behind, which expires after its TTL.
//
// Thread safety: an EtcdClient may be used from many threads at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "launcher/server/status.h"

namespace grpc {
class ClientContext;
}

namespace trn::control::etcd {

// "etcd://HOST:PORT[,HOST:PORT...]" -> {"HOST:PORT", ...} (HOST may be a name, an IPv4
// address or a bracketed IPv6 address). Throws trn's usage error, one line naming the URL and
// what is wrong with it.
std::vector<std::string> parse_endpoints(const std::string& url);

struct Options {
  std::chrono::milliseconds timeout{2000};  // deadline of each call (one page of a range), retries included
  int64_t page_size = 1000;                 // keys per Range call in range_prefix (>= 1)
  int max_receive_bytes = 256 << 20;        // largest gRPC answer accepted
  // TLS to etcd (PEM text, not paths): with a CA, every member's certificate is verified against
  // it; with a certificate and key too, this client presents them (etcd's --client-cert-auth).
  // No CA: plaintext.
  std::string tls_ca, tls_cert, tls_key;
};

struct KeyValue {
  std::string key, value;
  int64_t create_revision = 0;  // store revision that created the key; a new one after delete + put
  int64_t mod_revision = 0;     // store revision of its last change
  int64_t lease = 0;            // lease the key is attached to, 0 when none
};

// A value, valid when status.ok().
template <typename T>
struct Result {
  Status status;
  T value{};
  bool ok() const { return status.ok(); }
};

// One write of a transaction.
struct Write {
  std::string key, value;
  int64_t lease = 0;
  bool erase = false;  // delete key (value and lease unused)
  static Write put(std::string key, std::string value, int64_t lease = 0) {
    return {std::move(key), std::move(value), lease, false};
  }
  static Write remove(std::string key) { return {std::move(key), {}, 0, true}; }
};

struct Created {
  bool created = false;  // this call wrote the key
  KeyValue current;      // the key as it is now: ours when created, else the holder's
};

struct Lease {
  int64_t id = 0;
  int64_t ttl_s = 0;  // as granted: etcd raises a TTL below its minimum (see grant)
};

// One member's view (Maintenance.Status), for health checks.
struct MemberStatus {
  uint64_t member_id = 0;
  uint64_t leader = 0;  // member id of the leader it follows, 0 when it knows none
  uint64_t raft_term = 0;
  std::string version;  // etcd's version, e.g. "3.4.23"
};

struct Conn;  // the channels and stubs (etcd.cc), shared with LeaseKeeper

class EtcdClient {
 public:
  // endpoints: "HOST:PORT" each (see parse_endpoints); a usage error when empty. Connects
  // lazily: constructing never blocks and never fails for an unreachable etcd.
  explicit EtcdClient(std::vector<std::string> endpoints, Options options = {});
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  const std::vector<std::string>& endpoints() const;
  const Options& options() const;

  // Sets key to value, attached to lease (0: none; kNotFound when the lease is gone).
  Status put(const std::string& key, const std::string& value, int64_t lease = 0);
  // The key, or nullopt when absent. A linearizable read: it needs a quorum.
  Result<std::optional<KeyValue>> get(const std::string& key);
  // Every key that starts with prefix ("" = all keys), in key order, as of one store revision
  // (pages of Options::page_size keys, each its own call and deadline, all read at the revision
  // of the first; kInvalidArgument if etcd compacted that revision in between).
  Result<std::vector<KeyValue>> range_prefix(const std::string& prefix);
  // Deletes key / every key under prefix; the value is how many keys were deleted.
  Result<int64_t> delete_key(const std::string& key);
  Result<int64_t> delete_prefix(const std::string& prefix);

  // Leader fencing: runs writes atomically if and only if guard_key exists with create_revision
  // guard_create_revision (the leader key its holder created under its lease; deleting and
  // re-creating the key gives a new create_revision). The value is false, with nothing
  // written, when the guard failed; that is not an error. etcd refuses the same key twice in
  // writes (kInvalidArgument) and, by default, more than 128 writes.
  Result<bool> txn_put_if(const std::string& guard_key, int64_t guard_create_revision,
                          const std::vector<Write>& writes);
  // Creates key = value under lease unless key exists, atomically. created is false, and
  // current is the existing key, when someone holds it. A retry after an ambiguous failure
  // that finds our own value under our (non-zero) lease counts as created.
  Result<Created> create_if_absent(const std::string& key, const std::string& value, int64_t lease);

  // A new lease of ttl_s seconds. etcd grants at least its minimum TTL, 1.5 election timeouts
  // rounded up to whole seconds (2 s with etcd's defaults), and says so in the result.
  Result<Lease> grant(int64_t ttl_s);
  // Ends the lease now and deletes its keys; kNotFound when it had already expired or gone
  // (also when a first try that etcd applied was retried).
  Status revoke(int64_t lease_id);

  // The member at endpoints()[i]'s status, from that member only (no failover, no leader
  // needed): a health check.
  Result<MemberStatus> member_status(size_t i);

 private:
  friend class LeaseKeeper;
  std::shared_ptr<Conn> conn_;
};

// Keeps a lease alive from its own thread: refreshes it (etcd's LeaseKeepAlive stream) every
// TTL/3, and after a failed refresh retries every 100 ms on the next endpoint, each attempt
// bounded by min(TTL, Options::timeout) so that a hung member costs one attempt, not the lease.
//
// When no refresh has succeeded for a whole TTL since the last one that did (counted from when
// that refresh was sent), the lease is *in doubt*: it may have expired in etcd, so its holder
// must act as if it had not got it (on_doubt runs with the reason; in_doubt() is true). It may
// well not have: a new etcd leader extends every lease by its TTL when it takes over, and the
// TTL left after a refresh (2/3 of it) is shorter than an election can take at etcd's minimum
// TTL (1.5 election timeouts). So the keeper goes on trying. A refresh that succeeds proves the
// lease never expired (etcd renews no expired lease, and deletes its keys when it expires), so
// nobody else can have held what it guards in between: the doubt ends (on_doubt runs with "").
// The lease is lost, for good, when etcd answers that it no longer exists (TTL <= 0), or when
// the doubt lasts kDoubtTtls more TTLs without an answer (etcd without quorum, or cut off from
// this process). Then lost() turns true, lost_reason() says why in one line, on_lost runs once,
// and refreshing stops. Callbacks run on the keeper's thread and must not destroy the keeper.
// A lost lease may still exist in etcd (a leader elected after a quorum loss extends leases);
// its holder must act as if it did not.
class LeaseKeeper {
 public:
  using LostFn = std::function<void(const std::string& reason)>;
  // reason: why the lease is in doubt, or "" when a refresh has confirmed it again.
  using DoubtFn = std::function<void(const std::string& reason)>;
  static constexpr int kDoubtTtls = 2;
  // Starts refreshing at once; start it right after grant(), since until its first refresh
  // answers it counts the TTL from its own start. The client may be destroyed first.
  LeaseKeeper(const EtcdClient& client, Lease lease, LostFn on_lost = {}, DoubtFn on_doubt = {});
  // Stops the thread promptly (cancels a refresh in flight), also when etcd is unreachable.
  // Does not revoke the lease: it expires after its TTL unless the caller revokes it.
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  int64_t id() const { return lease_.id; }
  bool lost() const;
  std::string lost_reason() const;  // "" while not lost
  bool in_doubt() const;            // no refresh for a TTL, not (yet) lost

 private:
  void run();
  // One refresh on endpoint i: the TTL etcd answered, or a failure.
  Result<int64_t> refresh(size_t i, std::chrono::steady_clock::time_point deadline);

  std::shared_ptr<Conn> conn_;
  Lease lease_;
  LostFn on_lost_;
  DoubtFn on_doubt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool lost_ = false;
  bool doubt_ = false;
  std::string reason_;
  grpc::ClientContext* inflight_ = nullptr;  // the refresh to cancel on stop
  std::thread thread_;
};

}  // namespace trn::control::etcd
