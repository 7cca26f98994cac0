// Opening a file trn reads: every reader of a path (token shards, llm.c .bin and raw data,
// tokenizer models, safetensors, checkpoint manifests and shards, --init files) goes through
// here, so none can block on what is not a regular file.
//
// The path is opened O_NONBLOCK, then checked with fstat on the descriptor before a byte is
// read: a FIFO with no writer would block open() itself, and a FIFO or a terminal would block
// read(), so they are refused in one line instead (as are directories, sockets and devices).
// Checking the descriptor, not the path, leaves no window for the file to be swapped between
// check and read. O_NONBLOCK is cleared again once the file is known to be regular.
#pragma once

#include <cstddef>
#include <string>

namespace trn::io {

class InputFile {
 public:
  // `what` names the file in errors, e.g. "--init", "tokenizer" or "dataset file". Usage errors:
  // "cannot read WHAT PATH: REASON" when it cannot be opened, "WHAT PATH is a directory; give a
  // file", "WHAT PATH is a FIFO, not a regular file; give a file" (socket, device alike).
  InputFile(const std::string& what, const std::string& path);
  ~InputFile();
  InputFile(InputFile&& o) noexcept;
  InputFile& operator=(InputFile&&) = delete;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const { return fd_; }
  size_t size() const { return size_; }  // at open
  const std::string& path() const { return path_; }

  // The whole file. A usage error when a read fails or the file's size changes while it is read
  // (another process writing it).
  std::string read_all() const;

 private:
  std::string what_, path_;
  int fd_ = -1;
  size_t size_ = 0;
};

// InputFile(what, path).read_all().
std::string read_input_file(const std::string& what, const std::string& path);

}  // namespace trn::io
