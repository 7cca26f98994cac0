#include "collectives/fabric/mr_cache.h"

#include <unistd.h>

#include "collectives/core/error.h"
#include "collectives/core/log.h"

namespace trn::fabric {

MrCache::MrCache(fid_domain* domain, bool provider_keys, size_t max_entries)
    : domain_(domain), provider_keys_(provider_keys), max_entries_(max_entries) {}

MrCache::~MrCache() {
  for (auto& [start, e] : entries_) fi_close(&e.mr->fid);
}

MrCache::Handle MrCache::acquire(const void* buf, size_t len) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf), b = a + len;
  ++clock_;
  // The covering entry, if any, starts at or before a; look at the few nearest ones.
  auto it = entries_.upper_bound(a);
  for (int i = 0; i < 8 && it != entries_.begin(); ++i) {
    --it;
    if (it->second.end >= b) {
      it->second.last_use = clock_;
      ++it->second.refs;
      return it;
    }
  }
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t start = a & ~(page - 1), end = (b + page - 1) & ~(page - 1);
  auto same = entries_.find(start);
  if (same != entries_.end() && same->second.refs == 0) {  // a smaller region at the same start
    fi_close(&same->second.mr->fid);
    entries_.erase(same);
  } else if (same != entries_.end()) {
    // In use and too small: register exactly this buffer beside it.
    return acquire_unaligned(a, b);
  }
  evict_idle();
  fid_mr* mr = nullptr;
  int rc = fi_mr_reg(domain_, reinterpret_cast<void*>(start), end - start, FI_SEND | FI_RECV, 0,
                     provider_keys_ ? 0 : next_key_++, 0, &mr, nullptr);
  if (rc) throw internal_error("fi_mr_reg of {} bytes failed: {}", end - start, fi_strerror(-rc));
  ++registrations_;
  log::trace(log::Subsys::kFabric, "registered {:#x}+{}", start, end - start);
  return entries_.emplace(start, Entry{end, mr, clock_, 1}).first;
}

MrCache::Handle MrCache::acquire_unaligned(uintptr_t a, uintptr_t b) {
  evict_idle();
  fid_mr* mr = nullptr;
  int rc = fi_mr_reg(domain_, reinterpret_cast<void*>(a), b - a, FI_SEND | FI_RECV, 0,
                     provider_keys_ ? 0 : next_key_++, 0, &mr, nullptr);
  if (rc) throw internal_error("fi_mr_reg of {} bytes failed: {}", b - a, fi_strerror(-rc));
  ++registrations_;
  // Keyed at a, or just above it when taken, so it never replaces the entry in use.
  uintptr_t key = a;
  while (entries_.count(key)) ++key;
  return entries_.emplace(key, Entry{b, mr, clock_, 1}).first;
}

void MrCache::evict_idle() {
  while (entries_.size() >= max_entries_) {
    auto victim = entries_.end();
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->second.refs == 0 && (victim == entries_.end() || it->second.last_use < victim->second.last_use))
        victim = it;
    if (victim == entries_.end()) return;  // everything in use: grow past the bound
    fi_close(&victim->second.mr->fid);
    entries_.erase(victim);
  }
}

}  // namespace trn::fabric
