#include "collectives/bootstrap/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "collectives/core/error.h"
#include "collectives/core/settings.h"

namespace trn {
namespace {

Error io_error(const std::string& what, const std::string& path) {
  return internal_error("FileStore: {} {}: {}", what, path, std::strerror(errno));
}

void make_dirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    std::string part = dir.substr(0, i);
    if (mkdir(part.c_str(), 0777) != 0 && errno != EEXIST)
      throw usage_error("FileStore: cannot create directory {}: {} (set TRN_STORE_DIR to a writable directory)",
                        part, std::strerror(errno));
  }
}

// Key -> file name: [A-Za-z0-9_-] and inner dots stay, everything else becomes %XX.
std::string encode(const std::string& key) {
  static const char* d = "0123456789ABCDEF";
  std::string s;
  for (size_t i = 0; i < key.size(); ++i) {
    unsigned char c = key[i];
    if (std::isalnum(c) || c == '_' || c == '-' || (c == '.' && i > 0)) s += static_cast<char>(c);
    else s += {'%', d[c >> 4], d[c & 15]};
  }
  return s.empty() ? "%" : s;
}

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw io_error("write", path);
    off += static_cast<size_t>(n);
  }
}

}  // namespace

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {
  if (dir_.empty()) throw usage_error("FileStore: empty directory (set TRN_STORE_DIR)");
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  make_dirs(dir_);
}

std::unique_ptr<FileStore> FileStore::from_environment() {
  std::string dir = settings::get("TRN_STORE_DIR");
  if (dir.empty())
    throw usage_error("no bootstrap store: set TRN_STORE_DIR to a directory shared by all ranks (or run under trnrun)");
  return std::make_unique<FileStore>(dir);
}

std::string FileStore::path(const std::string& key) const { return dir_ + "/" + encode(key); }

void FileStore::set(const std::string& key, const std::string& value) {
  static std::atomic<uint64_t> counter{0};
  const std::string final_path = path(key);
  const std::string tmp = fmt::format("{}/.tmp.{}.{}", dir_, getpid(), counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw io_error("create", tmp);
  try {
    write_all(fd, value, tmp);
    if (fsync(fd) != 0) throw io_error("fsync", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw io_error("rename to", final_path);
  }
  int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);
    ::close(dfd);
  }
}

bool FileStore::try_get(const std::string& key, std::string* value) {
  const std::string p = path(key);
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return false;
    throw io_error("open", p);
  }
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      throw io_error("read", p);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  *value = std::move(out);
  return true;
}

std::string FileStore::get(const std::string& key, Deadline deadline) {
  std::string value;
  auto nap = std::chrono::milliseconds(1);
  while (!try_get(key, &value)) {
    if (deadline.expired())
      throw timeout_error("FileStore {}: key '{}' was not set by the deadline: did every rank start, with "
                          "the same TRN_STORE_DIR?", dir_, key);
    std::this_thread::sleep_for(std::min<Duration>(nap, deadline.remaining()));
    nap = std::min(nap * 2, std::chrono::milliseconds(20));
  }
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  const std::string lock_path = dir_ + "/.lock." + encode(key);
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw io_error("open", lock_path);
  const Deadline deadline = Deadline::from_default_timeout();
  auto nap = std::chrono::microseconds(100);
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      ::close(fd);
      throw io_error("flock", lock_path);
    }
    if (deadline.expired()) {
      ::close(fd);
      throw timeout_error("FileStore {}: could not lock '{}' by the deadline (a process holding it hangs?)",
                          dir_, key);
    }
    std::this_thread::sleep_for(nap);
    nap = std::min(nap * 2, std::chrono::microseconds(10000));
  }
  int64_t value = 0;
  try {
    std::string old;
    if (try_get(key, &old) && !old.empty()) {
      char* end = nullptr;
      value = std::strtoll(old.c_str(), &end, 10);
      if (*end != '\0') throw usage_error("FileStore {}: add on key '{}' whose value '{}' is not an integer", dir_, key, old);
    }
    value += delta;
    set(key, std::to_string(value));
  } catch (...) {
    flock(fd, LOCK_UN);
    ::close(fd);
    throw;
  }
  flock(fd, LOCK_UN);
  ::close(fd);
  return value;
}

}  // namespace trn
