// Happens-before edges that ThreadSanitizer cannot see by itself.
//
// Debian's gRPC is not built with TSan: when gRPC hands an object trn made on one thread to a
// callback on another (a server reactor's OnDone after its constructor), the ordering it
// guarantees goes through code TSan does not watch. tsan_publish(p) where trn gives p to such a
// library and tsan_receive(p) where the library gives it back state that ordering. Both compile to
// nothing outside the tsan preset (TRN_TSAN, set by CMakeLists.txt).
#pragma once

#if defined(TRN_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

namespace trn {

inline void tsan_publish([[maybe_unused]] const void* p) {
#if defined(TRN_TSAN)
  __tsan_release(const_cast<void*>(p));
#endif
}

inline void tsan_receive([[maybe_unused]] const void* p) {
#if defined(TRN_TSAN)
  __tsan_acquire(const_cast<void*>(p));
#endif
}

}  // namespace trn
