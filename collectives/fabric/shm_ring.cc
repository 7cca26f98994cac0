#include "collectives/fabric/shm_ring.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>

#include "collectives/core/error.h"

namespace trn::fabric {
namespace {

constexpr size_t round_up(size_t n) { return (n + kRingAlign - 1) & ~(kRingAlign - 1); }

}  // namespace

void remove_stale_shm_files() {
  static std::once_flag once;
  std::call_once(once, [] {
    DIR* d = opendir("/dev/shm");
    if (!d) return;
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      size_t skip = 0;
      if (name.rfind("trn_", 0) == 0) skip = 4;
      else if (name.rfind("trn-ring.", 0) == 0) skip = 9;
      else continue;
      const long pid = std::strtol(name.c_str() + skip, nullptr, 10);
      if (pid <= 0 || pid == getpid()) continue;
      if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) shm_unlink(("/" + name).c_str());
    }
    closedir(d);
  });
}

size_t ring_capacity_for(size_t eager) {
  size_t cap = size_t{64} << 10;
  while (cap < 4 * eager) cap *= 2;
  return cap;
}

RingWriter::RingWriter(void* base, size_t capacity)
    : ctl_(static_cast<RingControl*>(base)),
      data_(static_cast<char*>(base) + sizeof(RingControl)),
      capacity_(capacity) {
  head_ = ctl_->head.load(std::memory_order_relaxed) & ~uint64_t{kRingAlign - 1};
  cached_tail_ = ctl_->tail.load(std::memory_order_acquire);
}

bool RingWriter::write(uint64_t tag, uint32_t kind, const void* a, size_t alen, const void* b, size_t blen) {
  const size_t payload = ring_payload_offset(alen ? a : b, alen + blen);
  const size_t need = round_up(payload + alen + blen);
  if (need > capacity_) return false;  // whatever the tail says
  const size_t at = head_ & (capacity_ - 1);
  const size_t to_end = capacity_ - at;
  // When the reader has taken everything, start again at the front: small messages then keep
  // reusing the same few cache lines instead of walking the whole ring through the caches.
  bool restart = false;
  if (at != 0) {
    cached_tail_ = ctl_->tail.load(std::memory_order_acquire);
    restart = cached_tail_ == head_ && to_end + need <= capacity_;
  }
  // A pad first when restarting or when the record would wrap.
  const size_t total = need <= to_end && !restart ? need : to_end + need;
  if (head_ + total - cached_tail_ > capacity_) {
    cached_tail_ = ctl_->tail.load(std::memory_order_acquire);
    if (head_ + total - cached_tail_ > capacity_) return false;
  }
  if (total > need) {
    auto* pad = reinterpret_cast<RingRecordHeader*>(data_ + at);
    pad->tag = 0;
    pad->len = static_cast<uint32_t>(to_end - sizeof(RingRecordHeader));
    pad->kind = kRingPad;
    pad->offset = sizeof(RingRecordHeader);
    head_ += to_end;
  }
  char* p = data_ + (head_ & (capacity_ - 1));
  auto* h = reinterpret_cast<RingRecordHeader*>(p);
  h->tag = tag;
  h->len = static_cast<uint32_t>(alen + blen);
  h->kind = static_cast<uint16_t>(kind);
  h->offset = static_cast<uint16_t>(payload);
  if (alen) std::memcpy(p + payload, a, alen);
  if (blen) std::memcpy(p + payload + alen, b, blen);
  head_ += need;
  ctl_->head.store(head_, std::memory_order_release);
  return true;
}

RingReader::RingReader(void* base, size_t capacity)
    : ctl_(static_cast<RingControl*>(base)),
      data_(static_cast<char*>(base) + sizeof(RingControl)),
      capacity_(capacity) {
  tail_ = ctl_->tail.load(std::memory_order_relaxed);
  cached_head_ = ctl_->head.load(std::memory_order_acquire);
}

bool RingReader::peek(Record* r) {
  bool reread = false;
  for (;;) {
    if (tail_ == cached_head_) {
      // A writer publishes a pad and the record after it at once: one read of the head is
      // enough, and a writer that keeps moving it cannot keep this loop going.
      if (reread) return false;
      cached_head_ = ctl_->head.load(std::memory_order_acquire);
      reread = true;
      if (tail_ == cached_head_) return false;
    }
    const uint64_t ready = cached_head_ - tail_;
    const size_t at = tail_ & (capacity_ - 1);
    if (ready > capacity_ || ((ready | at) & (kRingAlign - 1)) != 0)
      throw remote_error(
          "it broke its shared-memory ring: its head is at {}, the reader at {}, in a {}-byte ring "
          "of 64-byte records",
          cached_head_, tail_, capacity_);
    // The header is read once: the writer may change it meanwhile, and what is checked must be
    // what is used. Relaxed atomic loads (plain loads on x86) keep the compiler from reading it
    // again from the ring.
    RingRecordHeader h;
    {
      auto* words = reinterpret_cast<uint64_t*>(data_ + at);
      const uint64_t w[2] = {std::atomic_ref<uint64_t>(words[0]).load(std::memory_order_relaxed),
                             std::atomic_ref<uint64_t>(words[1]).load(std::memory_order_relaxed)};
      static_assert(sizeof(w) == sizeof(h));
      std::memcpy(&h, w, sizeof(h));
    }
    const size_t size = round_up(size_t{h.offset} + h.len);
    if (h.offset < sizeof(h) || size > std::min<uint64_t>(ready, capacity_ - at))
      throw remote_error(
          "it wrote a malformed record into its shared-memory ring: at {} (of a {}-byte ring) a "
          "record of kind {} claims {} bytes from offset {}, but {} bytes are ready and {} left "
          "before the ring's end",
          tail_, capacity_, h.kind, h.len, h.offset, ready, capacity_ - at);
    if (h.kind == kRingPad) {  // skip it now: the producer only pads in front of a record
      tail_ += size;
      ctl_->tail.store(tail_, std::memory_order_release);
      continue;
    }
    r->tag = h.tag;
    r->kind = h.kind;
    r->len = h.len;
    r->data = data_ + at + h.offset;
    next_ = tail_ + size;
    return true;
  }
}

void throw_malformed_ring_payload(uint32_t kind, size_t len) {
  if (kind == kRingAck)
    throw remote_error("it wrote a malformed ack ({} bytes) into its shared-memory ring", len);
  throw remote_error("it wrote a malformed record (kind {}, {} bytes) into its shared-memory ring", kind,
                     len);
}

void RingReader::pop() {
  tail_ = next_;
  ctl_->tail.store(tail_, std::memory_order_release);
}

RingSegment RingSegment::create(size_t slots, size_t capacity) {
  remove_stale_shm_files();
  RingSegment s;
  s.slots_ = slots;
  s.capacity_ = capacity;
  s.bytes_ = slots * ring_footprint(capacity);
  std::random_device rd;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    s.name_ = fmt::format("/trn-ring.{}.{:08x}", getpid(), rd());
    fd = shm_open(s.name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) throw usage_error("creating the shared-memory ring segment {}: {}", s.name_, std::strerror(errno));
  s.owner_ = true;
  // Reserve the pages now: a tmpfs that runs out later would kill a writer with SIGBUS.
  if (int err = posix_fallocate(fd, 0, static_cast<off_t>(s.bytes_)); err != 0) {
    close(fd);
    throw usage_error("reserving {} bytes for the shared-memory ring segment {}: {} (is /dev/shm too small?)",
                      s.bytes_, s.name_, std::strerror(err));
  }
  s.base_ = mmap(nullptr, s.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (s.base_ == MAP_FAILED) {
    s.base_ = nullptr;
    throw usage_error("mapping the shared-memory ring segment {}: {}", s.name_, std::strerror(err));
  }
  return s;  // zero-filled: every ring starts empty
}

RingSegment RingSegment::open(const std::string& name, size_t slots, size_t capacity) {
  RingSegment s;
  s.name_ = name;
  s.slots_ = slots;
  s.capacity_ = capacity;
  s.bytes_ = slots * ring_footprint(capacity);
  int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0)
    throw remote_error("opening a peer's shared-memory ring segment {}: {} (is /dev/shm shared between the "
                       "ranks of this host?)", name, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < s.bytes_) {
    close(fd);
    throw remote_error("a peer's shared-memory ring segment {} is smaller than the {} bytes expected", name,
                       s.bytes_);
  }
  s.base_ = mmap(nullptr, s.bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (s.base_ == MAP_FAILED) {
    s.base_ = nullptr;
    throw remote_error("mapping a peer's shared-memory ring segment {}: {}", name, std::strerror(err));
  }
  return s;
}

RingSegment::RingSegment(RingSegment&& o) noexcept { *this = std::move(o); }

RingSegment& RingSegment::operator=(RingSegment&& o) noexcept {
  if (this != &o) {
    release();
    name_ = std::move(o.name_);
    owner_ = o.owner_;
    base_ = o.base_;
    bytes_ = o.bytes_;
    slots_ = o.slots_;
    capacity_ = o.capacity_;
    o.owner_ = false;
    o.base_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

RingSegment::~RingSegment() { release(); }

void RingSegment::release() {
  unlink();
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
}

void* RingSegment::ring(size_t slot) const {
  return static_cast<char*>(base_) + slot * ring_footprint(capacity_);
}

void RingSegment::unlink() {
  if (owner_) shm_unlink(name_.c_str());
  owner_ = false;
}

}  // namespace trn::fabric
