#include "launcher/server/state_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/core/error.h"

namespace trn::control {

void write_file_atomic(const std::string& path, const std::string& data) {
  std::filesystem::path p(path);
  std::string tmp = path + ".tmp." + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw usage_error("cannot write {}: {}", tmp, std::strerror(errno));
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      throw remote_error("writing {} failed: {}", tmp, std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw remote_error("fsync of {} failed: {}", tmp, std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    throw remote_error("rename {} -> {} failed: {}", tmp, path, std::strerror(errno));
  }
  std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

StateDir::StateDir(std::string dir) : dir_(std::move(dir)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw usage_error("--state-dir {}: cannot create it: {}", dir_, ec.message());
  if (::access(dir_.c_str(), W_OK) != 0)
    throw usage_error("--state-dir {} is not writable; pick a directory this user can write", dir_);
  file_ = (std::filesystem::path(dir_) / "state.pb").string();
}

std::optional<coordinator::v1::Snapshot> StateDir::load() {
  std::lock_guard lock(mu_);
  std::ifstream in(file_, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  coordinator::v1::Snapshot snap;
  if (!snap.ParseFromString(ss.str()))
    throw usage_error("{} is not a trn coordinator snapshot (corrupt?); move it away to start empty",
                      file_);
  return snap;
}

void StateDir::save(const coordinator::v1::Snapshot& snap) {
  std::lock_guard lock(mu_);
  std::string data;
  if (!snap.SerializeToString(&data)) throw internal_error("cannot serialize the coordinator snapshot");
  write_file_atomic(file_, data);
}

}  // namespace trn::control
