// One replica of a coordinator that keeps its state in etcd (trn-coordinator --store etcd://...).
//
// Election: the replicas race to create the leader key (<prefix>leader, value: the winner's
// --advertise address) under a lease of lease_ttl seconds, which the winner keeps alive
// (etcd::LeaseKeeper). A standby checks the key every 250 ms; when the leader dies its lease
// expires, etcd deletes the key, and the next standby to look creates it. Every write of the
// leader is fenced by the key's create_revision (etcd::EtcdClient::txn_put_if): a deposed leader
// that has not noticed yet cannot overwrite its successor's state.
//
// State in etcd, under the prefix:
//   jobs/<job_id>                   a job without its store and checkpoints (v1::Snapshot::Job)
//   kv/<job_id>/<generation>/<key>  one key of the job's store, its value
//   ckpt/<job_id>/<step>/<chunk>    a committed checkpoint, its shards in chunks of ~256 KiB
//   meta/next_event_seq             the event counter as of the last record (events after it, until
//                                   the next record, may see their numbers again under a new leader)
// The registry hands every change as a whole-job record (RegistryOptions::persist); the replica
// writes only the keys that changed since its last write, then the record, in transactions of
// at most 100 writes and 1 MiB (so no key grows with the job but the record's member list). The
// store keys carry their generation, so load() ignores those of a generation whose record never
// landed. A change is written before the call that made it is answered, except the store's
// keys, which the registry saves within 0.2 s (as with --state-dir); when a write fails, the
// replica stops serving at once and the call is answered UNAVAILABLE (CoordinatorService checks
// the refusal again after each call), so the client retries it on the next leader.
//
// Roles: elected, the replica loads the state and calls `elected` (restore it, accept calls),
// then serves. While its lease is in doubt (no refresh for a TTL: an etcd election, or etcd out
// of reach) it refuses calls but keeps its state, and serves again once a refresh proves the
// lease never expired. It stops serving, for good until it wins again, when its lease is lost
// (etcd says so, or no refresh for 3 TTLs) or a fenced write fails for good: `deposed` is
// called with the reason. A write that fails for want of an answer (UNAVAILABLE, a deadline:
// an etcd election) is retried for as long as the lease holds, since a fenced write is
// idempotent in effect. refusal() is what a call to a replica that does not serve is answered with:
// "standby coordinator; the leader is HOST:PORT", or why it stopped accepting writes. A replica
// that finds the state in etcd damaged (a record that does not parse, or that the registry
// refuses) does not lead on it: it refuses every call with the cause, logged once per cause and
// counted by Hooks::refused_state, until the record is mended or removed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "launcher/server/etcd.h"
#include "trn/coordinator/v1/coordinator.pb.h"

namespace trn::control {

struct ReplicaOptions {
  std::string store;                          // etcd://HOST:PORT[,HOST:PORT...]
  std::string prefix = "/trn/coordinator/";   // every key of this coordinator's state
  std::string advertise;                      // HOST:PORT clients reach this replica at
  int64_t lease_ttl_s = 2;                    // etcd raises it to its minimum
  etcd::Options etcd;                         // how to reach etcd (its TLS material, as PEM text)
};

class Replica {
 public:
  struct Hooks {
    // Called on the replica's thread with the state read from etcd; on return calls are served.
    std::function<void(const coordinator::v1::Snapshot&)> elected;
    // Called on the replica's thread when it stops serving (calls are already refused).
    std::function<void(const std::string& reason)> deposed;
    // Called on the replica's thread each time it won the leader key but refused to lead because
    // the state in etcd is damaged (a record that does not parse, or that `elected` refuses): it
    // then refuses every call, and campaigns again (every 250 ms) until the record is mended.
    std::function<void(const std::string& why)> refused_state;
  };
  // Checks the options (a usage error names the flag) and starts campaigning.
  Replica(ReplicaOptions options, Hooks hooks);
  // Stops campaigning and refuses every call from then on; a leader gives its lease back, so a
  // standby takes over at once. Idempotent; the destructor calls it.
  void stop();
  ~Replica();
  Replica(const Replica&) = delete;
  Replica& operator=(const Replica&) = delete;

  // RegistryOptions::persist: writes one record, fenced. A write that failed for good (refused,
  // fenced off, or unanswered until the lease was lost) deposes the replica.
  void persist(const coordinator::v1::LogRecord& rec);
  bool leader() const { return leader_.load(); }
  // "" while serving; else the UNAVAILABLE message for calls.
  std::string refusal() const;

 private:
  void run();
  // One attempt to become the leader: true when elected (and the state loaded).
  bool campaign();
  // Reads the whole state under the prefix; false (with why) when etcd cannot answer (*damaged
  // false) or holds a record that does not parse (*damaged true).
  bool load(coordinator::v1::Snapshot* snap, std::string* why, bool* damaged);
  // The state in etcd is damaged (why names the record): refuses every call with why, logs it
  // once per cause (each attempt would find it again, 4 a second) and counts it (refused_state).
  void refuse_damaged_state(const std::string& why);
  // Stops serving now (calls are refused from here on) and wakes the replica's thread to depose.
  // Ignored when not leading. Any thread.
  void lose(const std::string& why);
  void depose(const std::string& reason);
  void set_refusal(std::string why);

  ReplicaOptions options_;
  Hooks hooks_;
  std::unique_ptr<etcd::EtcdClient> etcd_;
  std::string leader_key_;

  std::atomic<bool> leader_{false};
  std::unique_ptr<etcd::LeaseKeeper> keeper_;  // the replica's thread only
  std::mutex write_mu_;         // one persist (or load) at a time; guards the two below
  int64_t guard_revision_ = 0;  // create_revision of our leader key while leader
  // What etcd holds of each job besides its record, as last written: only changes are written.
  struct Written {
    std::map<std::string, uint64_t> kv;     // etcd key -> XXH64 of the value
    std::map<int64_t, int> checkpoints;     // committed step -> its chunks
  };
  std::map<std::string, Written> written_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string lost_;     // set (by the keeper or a failed write) to depose the leader
  std::string refusal_ = "standby coordinator; no leader elected yet";
  std::string doubt_;    // while leading: why the lease is in doubt ("" when it is not)
  bool etcd_unreachable_logged_ = false;  // the replica's thread only
  std::string damaged_logged_;            // the damaged state's cause last logged; the replica's thread only
  std::thread thread_;
};

}  // namespace trn::control
