// connect()'s ring phase (setup.h): the shared-memory rings between the ranks of this host,
// and whether each may read the other's memory (the pull path, ring_channel.h).
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>

#include "collectives/core/log.h"
#include "collectives/fabric/setup.h"

// Linux 5.14's madvise advice; older C library headers lack the name (an older kernel refuses
// it with EINVAL, and map_pages' touches still fault every page in).
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace trn::fabric {
namespace {

// A value at a fixed address of this process that peers read (process_vm_readv) to learn whether
// they may read its memory: the pull path for long messages (ring_channel.h).
const uint64_t& pull_probe() {
  static const uint64_t probe = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32 | rd()) | 1;
  }();
  return probe;
}

// Whether this process may read process pid's memory, and why not. Reading the probe the peer
// published also proves that pid names the peer here (not a process of another pid namespace).
bool can_pull(int pid, uint64_t addr, uint64_t expect, std::string* why) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(addr), sizeof(got)};
  const ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(sizeof(got))) {
    *why = n < 0 ? fmt::format("process_vm_readv: {}", std::strerror(errno)) : "process_vm_readv: short read";
    return false;
  }
  if (got != expect) {
    *why = fmt::format("pid {} is another process here (another pid namespace?)", pid);
    return false;
  }
  return true;
}

// Whether this rank reads peer p's memory (pull_in), with a pidfd to watch its process; warns
// when not.
void check_pull(int rank, int p, const RingOffer& offer, RingPeer& peer, std::vector<int>& pulls) {
  // The pidfd first: once the probe read succeeds, it refers to the peer's process.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, offer.pid, 0));
  const int pidfd_errno = pidfd < 0 ? errno : 0;
  std::string why;
  if (can_pull(offer.pid, offer.probe_addr, offer.probe, &why)) {
    peer.pull_in = true;
    peer.pidfd = pidfd;
    pulls.push_back(p);
    if (pidfd < 0)
      log::warn(log::Subsys::kFabric, "rank {} cannot watch rank {}'s process (pidfd_open: {}): if it dies, "
                "operations with it fail only at their deadline", rank, p, std::strerror(pidfd_errno));
  } else {
    if (pidfd >= 0) close(pidfd);
    log::warn(log::Subsys::kFabric, "rank {} cannot read rank {}'s memory ({}): long messages from it take "
              "libfabric's shm", rank, p, why);
  }
}

// What one ring setup knows: this host's ranks, this rank's segment, and what it mapped.
struct RingSetup {
  std::vector<int> local;  // the ranks on this host, this one included, in rank order
  size_t me = 0;           // this rank's place among them
  RingSegment own;
  size_t capacity = 0;
  std::vector<RingSegment> segments;
  std::vector<std::string> users;  // the store keys of the peers that mapped own
  std::vector<int> mapped_peers;
  std::vector<int> pulls;  // the peers this rank reads long messages from
};

// Maps the segment of peer p (the i-th rank of this host) once it published one, and points the
// peer's rings into both segments.
void map_peer(Store& store, const Options& opts, int rank, size_t i, RingSetup& s, Peer& peer, Deadline deadline) {
  const int p = s.local[i];
  std::string value;
  try {
    value = store.get(opts.prefix + "/ring/" + std::to_string(p), deadline);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {}) waiting for rank {}'s ring segment", rank, p));
  }
  if (value.empty() || s.own.name().empty()) return;
  RingOffer offer;
  try {
    offer = RingOffer::decode(value);
  } catch (const Error& e) {
    throw e.with_context(fmt::format("rank {} published its ring segment", p));
  }
  RingSegment theirs = RingSegment::open(offer.name, s.local.size(), offer.capacity);
  // The ring this rank writes (in the peer's segment) and the one it reads (in its own): in the
  // page tables and touched now, not page by page during the job's operations (map_pages). The
  // data only: the first record goes in after connect, so nothing reads it yet.
  auto data = [](void* ring) { return static_cast<char*>(ring) + sizeof(RingControl); };
  // Both rings, whatever the first madvise says: the touches fault in what it did not populate.
  const bool out = map_pages(data(theirs.ring(s.me)), offer.capacity, true);
  const int out_errno = errno;
  const bool in = map_pages(data(s.own.ring(i)), s.capacity, false);
  if (!out || !in)
    log::debug(log::Subsys::kFabric, "rank {}: the rings with rank {} were touched page by page at connect (madvise: {})",
               rank, p, std::strerror(out ? errno : out_errno));
  peer.ring.on = true;
  peer.ring.out = RingWriter(theirs.ring(s.me), offer.capacity);
  peer.ring.in = RingReader(s.own.ring(i), s.capacity);
  peer.ring.eager = std::min(opts.ring_eager, offer.capacity / 4);
  peer.ring.pid = offer.pid;
  if (opts.pull) check_pull(rank, p, offer, peer.ring, s.pulls);
  s.segments.push_back(std::move(theirs));
  s.users.push_back(opts.prefix + "/ring-mapped/" + std::to_string(p));
  s.mapped_peers.push_back(p);
}

// Says which peers' memory this rank reads, waits until every peer that uses this rank's segment
// mapped it, and learns which of them read this rank's memory (pull_out).
void exchange_pull_reports(Store& store, const Options& opts, int rank, int size, RingSetup& s,
                           std::vector<Peer>& peers, Deadline deadline) {
  const std::string mapped = opts.prefix + "/ring-mapped/";
  store.set(mapped + std::to_string(rank), encode_pull_report(s.pulls));
  try {
    store.wait(s.users, deadline);
    for (int p : s.mapped_peers) {
      const std::string report = store.get(mapped + std::to_string(p), deadline);
      std::vector<int> readers;
      try {
        readers = decode_pull_report(report, size);
      } catch (const Error& e) {
        throw e.with_context(fmt::format("rank {}'s report", p));
      }
      peers[p].ring.pull_out = std::find(readers.begin(), readers.end(), rank) != readers.end();
    }
  } catch (const Error& e) {
    throw e.with_context(fmt::format("fabric connect (rank {}) waiting for same-host ranks to map its rings", rank));
  }
}

}  // namespace

bool map_pages(char* at, size_t len, bool write) {
  if (len == 0) return true;
  // madvise wants a page-aligned start; the pages around a range within one mapping belong to it.
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(at);
  const uintptr_t begin = first & ~(page - 1);
  const uintptr_t end = (first + len + page - 1) & ~(page - 1);
  const bool populated = madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0;
  const int err = errno;
  // One byte of the range in each page, from this thread. Atomic, and a write that keeps the
  // byte, since a peer may be using the mapping already.
  for (uintptr_t a = first; a < first + len; a = (a & ~(page - 1)) + page) {
    std::atomic_ref<char> byte(*reinterpret_cast<char*>(a));
    if (write) byte.fetch_add(0, std::memory_order_relaxed);
    else (void)byte.load(std::memory_order_relaxed);
  }
  errno = err;
  return populated;
}

// Each rank of this host that reaches others through shm creates one segment with a ring per
// rank of the host and publishes its name (empty when rings are off or the segment could not be
// made: then its pairs keep to libfabric alone), maps its peers' segments, and unlinks its own
// once every peer using it has mapped it. With the segment go its pid and its pull probe: each
// rank checks which peers' memory it may read and says so when it reports its mappings, so a
// sender knows whether its receiver pulls.
std::vector<RingSegment> setup_rings(Store& store, const Options& opts, int rank,
                                     const std::vector<AddressRecord>& all, std::vector<Peer>& peers,
                                     Deadline deadline) {
  RingSetup s;
  bool any = false;
  for (int p = 0; p < static_cast<int>(all.size()); ++p) {
    if (all[p].host_id != all[rank].host_id) continue;
    if (p == rank) s.me = s.local.size();
    s.local.push_back(p);
    any |= p != rank && peers[p].ep->provider() == "shm";
  }
  if (!any) return {};
  s.capacity = ring_capacity_for(opts.ring_eager);
  if (opts.ring) {
    try {
      s.own = RingSegment::create(s.local.size(), s.capacity);
    } catch (const Error& e) {
      log::warn(log::Subsys::kFabric, "{}; same-host peers use libfabric's shm alone", e.what());
    }
  }
  const RingOffer offer_mine{s.own.name(), s.capacity, getpid(), reinterpret_cast<uintptr_t>(&pull_probe()),
                             pull_probe()};
  store.set(opts.prefix + "/ring/" + std::to_string(rank), s.own.name().empty() ? "" : offer_mine.encode());
  struct ClosePidfds {  // until the Transport owns them
    std::vector<Peer>& peers;
    bool armed = true;
    ~ClosePidfds() {
      for (auto& p : peers)
        if (armed && p.ring.pidfd >= 0) close(std::exchange(p.ring.pidfd, -1));
    }
  } close_pidfds{peers};
  for (size_t i = 0; i < s.local.size(); ++i)
    if (s.local[i] != rank && peers[s.local[i]].ep->provider() == "shm")
      map_peer(store, opts, rank, i, s, peers[s.local[i]], deadline);
  if (s.own.name().empty()) return std::move(s.segments);
  exchange_pull_reports(store, opts, rank, static_cast<int>(all.size()), s, peers, deadline);
  s.own.unlink();  // a rank killed from here on leaves nothing behind in /dev/shm
  close_pidfds.armed = false;
  s.segments.push_back(std::move(s.own));
  return std::move(s.segments);
}

}  // namespace trn::fabric
