#include "runtime/io/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "collectives/core/error.h"

namespace trn::io {
namespace {

// What a non-regular file is, for the error line.
const char* kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a file";
}

}  // namespace

InputFile::InputFile(const std::string& what, const std::string& path) : what_(what), path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd_ < 0) throw usage_error("cannot read {} {}: {}", what, path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int e = errno;
    ::close(fd_);
    throw usage_error("cannot read {} {}: {}", what, path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    if (S_ISDIR(st.st_mode)) throw usage_error("{} {} is a directory; give a file", what, path);
    throw usage_error("{} {} is {}, not a regular file; give a file", what, path, kind_of(st.st_mode));
  }
  // A regular file never blocks; clearing the flag keeps reads plain (no EAGAIN to handle).
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  size_ = size_t(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile::InputFile(InputFile&& o) noexcept
    : what_(std::move(o.what_)), path_(std::move(o.path_)), fd_(o.fd_), size_(o.size_) {
  o.fd_ = -1;
}

std::string InputFile::read_all() const {
  std::string bytes(size_, '\0');
  size_t done = 0;
  while (done < size_) {
    const ssize_t n = ::pread(fd_, bytes.data() + done, size_ - done, off_t(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw usage_error("cannot read {} {}: {}", what_, path_, std::strerror(errno));
    if (n == 0) break;
    done += size_t(n);
  }
  char extra;
  const bool grew = done == size_ && ::pread(fd_, &extra, 1, off_t(done)) > 0;
  if (done != size_ || grew)
    throw usage_error("cannot read {} {}: it changed size while being read (another process is writing it)",
                      what_, path_);
  return bytes;
}

std::string read_input_file(const std::string& what, const std::string& path) {
  return InputFile(what, path).read_all();
}

}  // namespace trn::io
