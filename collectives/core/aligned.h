// Cache-line-aligned storage for buffers that cross the wire.
//
// Buffers trn sends from or receives into are 64-byte aligned, as a tensor library's are. Over
// tcp the kernel copies each message between the buffer and socket pages that hold it after a
// 32-byte wire header, 64 bytes in a world of two ranks (Endpoint::Pad): with the buffer aligned
// alike, the copy's source and destination are too, and it runs at full speed. glibc's malloc
// returns large blocks 16 bytes past a page boundary, which puts the destination 16 bytes past
// the source (modulo a page), a distance at which `rep movsb` on AMD Zen cores copies markedly
// slower (bench/results/2026-11-30-buffer-alignment.md).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace trn {

inline constexpr size_t kBufferAlign = 64;

template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kBufferAlign}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{kBufferAlign}); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const AlignedAllocator<U>&) const { return false; }
};

template <class T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace trn
