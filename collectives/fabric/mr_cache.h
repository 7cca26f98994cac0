// Memory registration cache for providers whose mr_mode has FI_MR_LOCAL (EFA): a training loop
// sends from the same buffers every step, so each buffer is registered once and reused.
//
// Regions are registered page-aligned. An entry in use by an outstanding operation is never
// evicted; beyond max_entries the least recently used idle entry is closed. Entries live until
// eviction or until the endpoint closes: a buffer freed and re-allocated at the same address
// must not be handed to the fabric while its stale registration is cached (trn's communicators
// keep their buffers for their whole life, which is the pattern this cache serves).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstddef>
#include <cstdint>
#include <map>

namespace trn::fabric {

class MrCache {
 public:
  struct Entry {
    uintptr_t end = 0;
    fid_mr* mr = nullptr;
    uint64_t last_use = 0;
    int refs = 0;
  };
  using Handle = std::map<uintptr_t, Entry>::iterator;

  MrCache(fid_domain* domain, bool provider_keys, size_t max_entries = 512);
  ~MrCache();
  MrCache(const MrCache&) = delete;
  MrCache& operator=(const MrCache&) = delete;

  // A registration covering [buf, buf + len) (len > 0), with one more reference.
  Handle acquire(const void* buf, size_t len);
  void release(Handle h) { --h->second.refs; }
  static void* desc(Handle h) { return fi_mr_desc(h->second.mr); }

  size_t size() const { return entries_.size(); }
  uint64_t registrations() const { return registrations_; }

 private:
  Handle acquire_unaligned(uintptr_t a, uintptr_t b);
  void evict_idle();

  fid_domain* domain_;
  bool provider_keys_;
  size_t max_entries_;
  std::map<uintptr_t, Entry> entries_;  // by region start
  uint64_t clock_ = 0;
  uint64_t next_key_ = 1;
  uint64_t registrations_ = 0;
};

}  // namespace trn::fabric
