// map_pages (collectives/fabric/setup.h): the pages of a shared-memory range are in this
// process's page tables once it returns, from the page holding its start to the page holding its
// end, and no others, and the bytes are what they were; before it, a fresh mapping has none
// (they would fault in on first touch, as the rings' deeper pages did during operations).
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include "collectives/fabric/setup.h"

namespace {

// Whether the page holding p is in this process's page tables (/proc/self/pagemap, bit 63).
bool present(const void* p) {
  const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uint64_t entry = 0;
  const ssize_t n = pread(fd, &entry, sizeof(entry), static_cast<off_t>(reinterpret_cast<uintptr_t>(p) / page * 8));
  close(fd);
  REQUIRE(n == static_cast<ssize_t>(sizeof(entry)));
  return entry >> 63;
}

}  // namespace

TEST_CASE("map_pages maps the pages a shared range touches, and only those, and keeps their bytes") {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = 6 * page;
  const int fd = memfd_create("trn-populate-test", MFD_CLOEXEC);
  REQUIRE(fd >= 0);
  REQUIRE(posix_fallocate(fd, 0, static_cast<off_t>(bytes)) == 0);  // as RingSegment::create
  auto* base = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  REQUIRE(base != MAP_FAILED);
  for (size_t i = 0; i < 6; ++i) CHECK_FALSE(present(base + i * page));
  // A ring's data in its segment: not page aligned (192 bytes of control before each ring).
  char* const at = base + page + 192;
  const size_t len = 2 * page;
  for (bool write : {false, true}) {
    CAPTURE(write);
    // The bytes a peer may have written already stay as they are.
    for (size_t k = 0; k < len; k += 97) at[k] = static_cast<char>(k % 251 + 1);
    REQUIRE(madvise(base, bytes, MADV_DONTNEED) == 0);  // out of the page tables again (the bytes stay)
    REQUIRE_FALSE(present(at));
    const bool populated = trn::fabric::map_pages(at, len, write);
    if (!populated) REQUIRE(errno == EINVAL);  // no MADV_POPULATE_WRITE (Linux 5.14): the touches map them
    CHECK_FALSE(present(base));
    CHECK(present(base + page));
    CHECK(present(base + 2 * page));
    CHECK(present(base + 3 * page));  // holds the range's last 192 bytes
    CHECK_FALSE(present(base + 4 * page));
    CHECK_FALSE(present(base + 5 * page));
    for (size_t k = 0; k < len; k += 97) CHECK(at[k] == static_cast<char>(k % 251 + 1));
  }
  munmap(base, bytes);
}
