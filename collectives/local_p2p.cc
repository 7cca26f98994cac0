#include "collectives/local_p2p.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "collectives/core/error.h"

namespace trn {
namespace {

struct OpState {
  bool done = false;
  bool failed = false;
  std::string error;
  ErrorKind kind = ErrorKind::kInternal;
  size_t bytes = 0;
};

struct PendingSend {
  std::shared_ptr<OpState> state;
  const void* buf;
  size_t len;
};
struct PendingRecv {
  std::shared_ptr<OpState> state;
  void* buf;
  size_t len;
};

struct Hub {
  std::mutex mu;
  std::vector<std::condition_variable> cv;  // per rank: its waiters sleep here
  // Per destination rank: unmatched sends and receives keyed by (source, tag).
  std::vector<std::map<std::pair<int, uint64_t>, std::deque<PendingSend>>> sends;
  std::vector<std::map<std::pair<int, uint64_t>, std::deque<PendingRecv>>> recvs;
  std::vector<std::string> abort_reason;  // per rank; non-empty once aborted
};

void complete(const PendingSend& s, const PendingRecv& r) {
  if (s.len > r.len) {
    r.state->failed = true;
    r.state->kind = ErrorKind::kRemote;
    r.state->error = "received message of " + std::to_string(s.len) + " bytes into a buffer of " +
                     std::to_string(r.len);
  } else if (s.len > 0) {
    std::memcpy(r.buf, s.buf, s.len);
  }
  r.state->bytes = s.len;
  s.state->bytes = s.len;
  r.state->done = s.state->done = true;
}

class LocalRequest : public Request {
 public:
  LocalRequest(std::shared_ptr<Hub> hub, int rank, std::shared_ptr<OpState> st, std::string what)
      : hub_(std::move(hub)), rank_(rank), st_(std::move(st)), what_(std::move(what)) {}

  bool test() override {
    std::lock_guard lock(hub_->mu);
    return check_locked();
  }
  void wait(Deadline deadline) override {
    std::unique_lock lock(hub_->mu);
    while (!check_locked()) {
      if (hub_->cv[rank_].wait_until(lock, deadline.when()) == std::cv_status::timeout && !check_locked())
        throw timeout_error("timed out waiting for {}", what_);
    }
  }
  size_t bytes() const override { return st_->bytes; }

 private:
  bool check_locked() {
    if (st_->failed) throw Error(st_->kind, what_ + ": " + st_->error);
    if (st_->done) return true;
    const std::string& reason = hub_->abort_reason[rank_];
    if (!reason.empty()) throw aborted_error("{} aborted: {}", what_, reason);
    return false;
  }
  std::shared_ptr<Hub> hub_;
  int rank_;
  std::shared_ptr<OpState> st_;
  std::string what_;
};

class LocalP2P : public PointToPoint {
 public:
  LocalP2P(std::shared_ptr<Hub> hub, int rank, int size, std::shared_ptr<const std::vector<int>> hosts)
      : hub_(std::move(hub)), rank_(rank), size_(size), hosts_(std::move(hosts)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len) override {
    check_peer(peer);
    auto st = std::make_shared<OpState>();
    {
      std::lock_guard lock(hub_->mu);
      throw_if_aborted();
      PendingSend s{st, buf, len};
      auto& m = hub_->recvs[peer];
      auto it = m.find({rank_, tag});
      if (it != m.end()) {
        complete(s, it->second.front());
        it->second.pop_front();
        if (it->second.empty()) m.erase(it);
        hub_->cv[peer].notify_all();
      } else {
        hub_->sends[peer][{rank_, tag}].push_back(s);
      }
    }
    return std::make_shared<LocalRequest>(hub_, rank_, st, describe_op("send to", peer, tag));
  }

  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len) override {
    check_peer(peer);
    auto st = std::make_shared<OpState>();
    {
      std::lock_guard lock(hub_->mu);
      throw_if_aborted();
      PendingRecv r{st, buf, len};
      auto& m = hub_->sends[rank_];
      auto it = m.find({peer, tag});
      if (it != m.end()) {
        complete(it->second.front(), r);
        it->second.pop_front();
        if (it->second.empty()) m.erase(it);
        hub_->cv[peer].notify_all();
      } else {
        hub_->recvs[rank_][{peer, tag}].push_back(r);
      }
    }
    return std::make_shared<LocalRequest>(hub_, rank_, st, describe_op("receive from", peer, tag));
  }

  void progress() override {}

  void abort(const std::string& reason) override {
    std::lock_guard lock(hub_->mu);
    if (hub_->abort_reason[rank_].empty()) hub_->abort_reason[rank_] = reason.empty() ? "aborted" : reason;
    hub_->cv[rank_].notify_all();
  }
  bool aborted() const override {
    std::lock_guard lock(hub_->mu);
    return !hub_->abort_reason[rank_].empty();
  }
  std::string describe() const override { return "local (in-process) rank " + std::to_string(rank_); }
  int host_of(int peer) const override { return hosts_->empty() ? 0 : (*hosts_)[peer]; }

 private:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= size_) throw internal_error("peer {} out of range [0, {})", peer, size_);
  }
  void throw_if_aborted() const {
    if (!hub_->abort_reason[rank_].empty()) throw aborted_error("aborted: {}", hub_->abort_reason[rank_]);
  }
  std::string describe_op(const char* what, int peer, uint64_t tag) const {
    return fmt::format("{} rank {} (tag {:#x})", what, peer, tag);
  }
  std::shared_ptr<Hub> hub_;
  int rank_, size_;
  std::shared_ptr<const std::vector<int>> hosts_;
};

}  // namespace

std::vector<std::shared_ptr<PointToPoint>> make_local_group(int size, std::vector<int> hosts) {
  if (size < 1) throw usage_error("a local group needs at least one rank, not {}", size);
  if (!hosts.empty() && static_cast<int>(hosts.size()) != size)
    throw usage_error("a local group of {} ranks was given hosts for {}", size, hosts.size());
  auto host_list = std::make_shared<const std::vector<int>>(std::move(hosts));
  auto hub = std::make_shared<Hub>();
  hub->cv = std::vector<std::condition_variable>(size);
  hub->sends.resize(size);
  hub->recvs.resize(size);
  hub->abort_reason.resize(size);
  std::vector<std::shared_ptr<PointToPoint>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_shared<LocalP2P>(hub, r, size, host_list));
  return out;
}

}  // namespace trn
