#include "runtime/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/io/input_file.h"

namespace trn::io {
namespace {

std::string parent_dir(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

void check_writable(const std::string& flag, const std::string& path) {
  struct stat st;
  if (path.empty() || path.back() == '/' || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)))
    throw usage_error("{} {} is a directory; give a file name inside it", flag, path);
  const std::string dir = parent_dir(path);
  if (::stat(dir.c_str(), &st) != 0)
    throw usage_error("{} {}: directory {} does not exist; create it first", flag, path, dir);
  if (!S_ISDIR(st.st_mode)) throw usage_error("{} {}: {} is not a directory", flag, path, dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw usage_error("{} {}: directory {} is not writable: {}", flag, path, dir, std::strerror(errno));
}

void make_writable_dir(const std::string& flag, const std::string& dir) {
  for (size_t at = dir.find('/', 1);; at = dir.find('/', at + 1)) {
    const std::string part = dir.substr(0, at);
    struct stat st;
    if (!part.empty() && ::stat(part.c_str(), &st) != 0 && ::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw usage_error("cannot create {} {}: mkdir {} failed: {}", flag, dir, part, std::strerror(errno));
    if (at == std::string::npos) break;
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw usage_error("{} {} exists and is not a directory; give a directory", flag, dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    throw usage_error("{} {} is not writable: {}", flag, dir, std::strerror(errno));
}

void check_readable_file(const std::string& flag, const std::string& path) { const InputFile opened(flag, path); }

void write_file_atomic(const std::string& path, std::initializer_list<std::string_view> pieces) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    throw usage_error("cannot write {}: {}; check that its directory exists and is writable", path,
                      std::strerror(errno));
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw usage_error("cannot write {}: {} failed: {}", path, what, std::strerror(err));
  };
  for (std::string_view piece : pieces) {
    const char* p = piece.data();
    size_t left = piece.size();
    while (left > 0) {
      const ssize_t n = ::write(fd, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("write");
      }
      p += n;
      left -= size_t(n);
    }
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw usage_error("cannot write {}: close failed: {}", path, std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw usage_error("cannot write {}: rename failed: {}", path, std::strerror(err));
  }
  const int dfd = ::open(parent_dir(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, {bytes});
}

}  // namespace trn::io
