#include "collectives/fabric/ring_channel.h"

#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "collectives/core/log.h"
#include "collectives/fabric/tag.h"

namespace trn::fabric {
namespace {

constexpr auto kExitCheck = std::chrono::milliseconds(10);  // how often a waiter looks for ended peers

}  // namespace

RingChannel::RingChannel(Hub& hub, FabricChannel& fabric, int rank, int size, std::vector<RingPeer> peers,
                         std::vector<RingSegment> segments)
    : hub_(hub), fabric_(fabric), rank_(rank), size_(size), peers_(std::move(peers)), segments_(std::move(segments)) {
  for (int q = 0; q < size_; ++q)
    if (peers_[q].on) ring_peers_.push_back(q);
}

RingChannel::~RingChannel() { close(); }

std::string RingChannel::describe() const {
  if (ring_peers_.empty()) return "";
  return fmt::format(" + shared-memory rings to {} rank(s) (messages up to {} bytes inside)", ring_peers_.size(),
                     peers_[ring_peers_[0]].eager);
}

void RingChannel::send(const std::shared_ptr<Op>& op) {
  RingPeer& p = peers_[op->peer];
  if (op->len <= p.eager) {
    op->ring.eager = true;
  } else if (p.pull_out) {
    op->ring.pull = true;
    op->wire_tag = wire::bulk(p.next_bulk++);  // only the sequence number matters: the ack echoes it
  } else {
    op->wire_tag = wire::bulk(p.next_bulk++);  // the record carries the sequence number
    op->held = true;                           // complete once its record is written, too
    fabric_.start(op, true);
  }
  p.sends.push_back(op);
  flush(p);
}

void RingChannel::flush(RingPeer& p) {
  while (!p.acks.empty()) {
    const RingAck ack{p.acks.front().first};
    if (!p.out.write(0, kRingAck, &ack, sizeof(ack))) return;
    if (Op* op = p.acks.front().second.get(); op && !op->done) hub_.finish(*op, std::nullopt);
    p.acks.pop_front();
  }
  while (!p.sends.empty()) {
    Op& op = *p.sends.front();
    if (!op.done) {
      bool written;
      const uint64_t seq = op.wire_tag & wire::kSeqMask;
      if (op.ring.eager) {
        written = p.out.write(op.msg_tag, kRingEager, op.buf, op.len);
      } else if (op.ring.pull) {
        const RingPull rec{op.len, seq, reinterpret_cast<uintptr_t>(op.buf)};
        written = p.out.write(op.msg_tag, kRingPull, &rec, sizeof(rec));
      } else {
        const RingLong rec{op.len, seq};
        written = p.out.write(op.msg_tag, kRingLong, &rec, sizeof(rec));
      }
      if (!written) return;  // full: the peer has not taken earlier records yet
      if (op.ring.eager) {
        op.bytes = op.len;
        hub_.finish(op, std::nullopt);
      } else if (op.ring.pull) {
        p.pulled.emplace(seq, p.sends.front());  // complete when the peer acknowledges
      } else {
        op.held = false;  // its bytes may have gone already (an inject completes at once)
        if (FabricChannel::sent_all(op)) hub_.finish(op, std::nullopt);
      }
    }
    p.sends.pop_front();  // a failed op's record is not needed any more
  }
}

void RingChannel::recv(const std::shared_ptr<Op>& op) {
  RingPeer& p = peers_[op->peer];
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    if (it->tag != op->wire_tag) continue;
    Unexpected u = std::move(*it);
    p.unexpected.erase(it);
    deliver(op, u.kind, u.data.data(), u.data.size());
    return;
  }
  p.recvs.push_back(op);
  drain(p);
}

// Records are taken in arrival order while some receive from this peer is posted or some pulled
// send waits for its ack: one that matches no receive waits in p.unexpected (its bytes copied
// out) so those behind it can match. Otherwise they stay in the ring, and the sender waits when
// it is full. A peer that ended is drained to the end (what it wrote before still arrives), then
// everything still pending with it fails.
void RingChannel::drain(RingPeer& p) {
  RingReader::Record r;
  for (;;) {
    while (!p.recvs.empty() && p.recvs.front()->done) p.recvs.pop_front();  // failed meanwhile
    if (p.recvs.empty() && p.pulled.empty() && p.exited.empty()) break;
    try {
      if (!p.in.peek(&r)) break;
    } catch (const Error& e) {  // it broke its ring (shm_ring.h)
      hub_.lose(index(p), e.what());
      break;
    }
    if (r.kind == kRingAck) {
      on_ack(p, r.data, r.len);
      p.in.pop();
      continue;
    }
    auto it = std::find_if(p.recvs.begin(), p.recvs.end(),
                           [&](const std::shared_ptr<Op>& o) { return !o->done && o->wire_tag == r.tag; });
    if (it != p.recvs.end()) {
      std::shared_ptr<Op> op = std::move(*it);
      p.recvs.erase(it);
      deliver(op, r.kind, r.data, r.len);
    } else {
      p.unexpected.push_back({r.tag, r.kind, std::vector<char>(r.data, r.data + r.len)});
    }
    p.in.pop();
  }
  if (!p.exited.empty()) {
    for (auto& [seq, op] : p.acks)  // pulled in full: only the ack to the ended peer is left
      if (op && !op->done) hub_.finish(*op, std::nullopt);
    p.acks.clear();
    // What the caller still waits for with it never comes: the peer is lost. Nothing pending
    // with it is a peer that finished and exited.
    if (hub_.user_ops_with(index(p))) hub_.lose(index(p), p.exited);
    p.recvs.clear();
    p.sends.clear();
    p.pulled.clear();
  }
}

void RingChannel::on_ack(RingPeer& p, const char* data, size_t len) {
  RingAck ack;
  try {
    ack = decode_ring_payload(kRingAck, data, len, p.pull_in).ack;
  } catch (const Error& e) {
    hub_.lose(index(p), e.what());
    return;
  }
  auto it = p.pulled.find(ack.seq);
  if (it == p.pulled.end()) return;  // the send failed meanwhile
  std::shared_ptr<Op> op = std::move(it->second);
  p.pulled.erase(it);
  op->bytes = op->len;
  hub_.finish(*op, std::nullopt);
}

// Copies a long message's bytes out of the sender's memory, then acks; the receive completes once
// the ack is written. A message longer than the receive fails the receive only (as a truncation
// does on libfabric); the sender is acknowledged either way, except when its process is gone.
void RingChannel::pull(const std::shared_ptr<Op>& op, const RingPull& rec) {
  RingPeer& p = peers_[op->peer];
  if (!p.exited.empty()) {  // its pid may name another process by now
    hub_.finish(*op, remote_error("{} (receiving {} bytes from it)", p.exited, rec.length));
    return;
  }
  if (rec.length > op->len) {
    hub_.finish(*op, remote_error("a message from {} with tag {:#x} is {} bytes, longer than the {}-byte receive "
                                  "buffer", hub_.peer_name(op->peer), wire::user_part(op->msg_tag), rec.length, op->len));
  } else {
    if (!read_bytes(op, rec)) return;  // the sender is gone: nobody waits for the ack
    // The sender closes its side of the ring when it aborts, before its buffers may be reused:
    // a pull that ends before the close is seen read bytes the send still owned.
    if (!op->done && p.in.writer_closed())
      hub_.finish(*op, remote_error("{} aborted before its {}-byte message to rank {} was read",
                                    hub_.peer_name(op->peer), rec.length, rank_));
    if (!op->done) op->bytes = rec.length;
  }
  p.acks.emplace_back(rec.seq, op->done ? nullptr : op);
  flush(p);
}

// process_vm_readv until every byte is in, or it fails (the op then fails). False when the
// sender's process is gone: the peer is lost, and nothing is to be acknowledged.
bool RingChannel::read_bytes(const std::shared_ptr<Op>& op, const RingPull& rec) {
  RingPeer& p = peers_[op->peer];
  size_t done = 0;
  while (done < rec.length) {
    iovec local{op->buf + done, rec.length - done};
    iovec remote{reinterpret_cast<void*>(rec.addr + done), rec.length - done};
    const ssize_t got = process_vm_readv(p.pid, &local, 1, &remote, 1, 0);
    if (got > 0) {
      done += static_cast<size_t>(got);
      continue;
    }
    const int err = got < 0 ? errno : EFAULT;
    if (err == EINTR) continue;
    if (err == EFAULT && p.in.writer_closed()) break;  // an aborted sender freed the buffer: the caller says so
    // A sender killed mid-message: ESRCH, or EFAULT while its memory is being torn down.
    if (err == ESRCH || (err == EFAULT && ending(p))) {
      hub_.lose(op->peer, fmt::format("{} (receiving {} bytes from it)", exit_text(op->peer), rec.length));
      next_exit_check_ = {};  // the next progress marks it exited
      return false;
    }
    hub_.finish(*op, remote_error("receiving {} bytes from {}: reading them from its memory failed after {} bytes: {}",
                                  rec.length, hub_.peer_name(op->peer), done, std::strerror(err)));
    break;
  }
  return true;
}

void RingChannel::deliver(const std::shared_ptr<Op>& op, uint32_t kind, const char* data, size_t len) {
  RingPayload m;
  try {
    m = decode_ring_payload(kind, data, len, peers_[op->peer].pull_in);
  } catch (const Error& e) {
    hub_.lose(op->peer, e.what());
    return;
  }
  if (m.kind == kRingAck) {  // never: drain takes acks before they meet a receive
    hub_.lose(op->peer, "it wrote an ack into its shared-memory ring where a message belongs");
    return;
  }
  if (m.kind == kRingEager) {
    if (len > op->len) {
      hub_.finish(*op, remote_error("a message from {} with tag {:#x} is {} bytes, longer than the {}-byte receive "
                                    "buffer", hub_.peer_name(op->peer), wire::user_part(op->msg_tag), len, op->len));
      return;
    }
    if (len) std::memcpy(op->buf, data, len);
    op->bytes = len;
    hub_.finish(*op, std::nullopt);
    return;
  }
  if (m.kind == kRingPull) {
    pull(op, m.pull);
    return;
  }
  op->wire_tag = wire::bulk(m.long_msg.seq);
  fabric_.start(op, false);  // a longer message than op->len fails as a truncation
}

void RingChannel::progress() {
  check_exits();
  for (int peer : ring_peers_) {
    RingPeer& p = peers_[peer];
    if (!p.sends.empty() || !p.acks.empty()) flush(p);
    if (!p.recvs.empty() || !p.pulled.empty()) drain(p);
  }
}

void RingChannel::check_exits() {
  const auto now = Clock::now();
  if (now < next_exit_check_) return;
  next_exit_check_ = now + kExitCheck;
  // A ring peer that lost a rank says so in its ring's closed word.
  for (int peer : ring_peers_) {
    const int lost = ring_lost_rank(peers_[peer].in.closed_code(), size_);
    if (lost >= 0) hub_.lose(lost, "it told this rank through shared memory", peer);
  }
  pollfd fds[64];
  int who[64];
  nfds_t n = 0;
  for (int peer : ring_peers_) {
    const RingPeer& p = peers_[peer];
    if (p.pidfd < 0 || !p.exited.empty()) continue;
    fds[n] = {p.pidfd, POLLIN, 0};
    who[n] = peer;
    if (++n == std::size(fds)) break;  // more same-host peers than this: the rest at their deadline
  }
  if (n == 0 || poll(fds, n, 0) <= 0) return;
  for (nfds_t i = 0; i < n; ++i)
    if (fds[i].revents & (POLLIN | POLLHUP)) peer_exited(who[i]);
}

std::string RingChannel::exit_text(int peer) const {
  return fmt::format("{} ended: its process (pid {}) on this host exited or was killed", hub_.peer_name(peer),
                     peers_[peer].pid);
}

bool RingChannel::ending(const RingPeer& p) {
  if (p.pidfd < 0) return false;
  pollfd fd{p.pidfd, POLLIN, 0};
  return poll(&fd, 1, 100) > 0;  // an exiting process signals its pidfd once its memory is gone
}

void RingChannel::peer_exited(int peer) {
  RingPeer& p = peers_[peer];
  p.exited = exit_text(peer);
  log::error(log::Subsys::kFabric, "rank {}: {}", rank_, p.exited);
  drain(p);
}

void RingChannel::close_lost(int lost) {
  for (int q : ring_peers_) peers_[q].out.close(kRingClosedLost + static_cast<uint64_t>(lost));
}

void RingChannel::forget_pulled() {
  for (int q : ring_peers_) peers_[q].pulled.clear();
}

void RingChannel::close() {
  for (auto& p : peers_) {
    if (p.on) p.out.close();
    p.on = false;
    p.sends.clear();
    p.recvs.clear();
    p.unexpected.clear();
    p.acks.clear();
    p.pulled.clear();
    if (p.pidfd >= 0) ::close(std::exchange(p.pidfd, -1));
  }
  ring_peers_.clear();
  segments_.clear();
}

}  // namespace trn::fabric
