// Writing files so that readers never see half of one: write to PATH.tmp.<pid>, fsync, rename
// over PATH, fsync the directory.
#pragma once

#include <string>
#include <string_view>

namespace trn::io {

// Usage error naming `flag` and the path when write_file_atomic(path) would fail for a reason
// known now: the path is a directory, its directory is missing, not a directory or not
// writable. Called before work whose result goes there starts.
void check_writable(const std::string& flag, const std::string& path);

// Creates dir and its missing parents (mode 0755; one that exists already is fine, so ranks
// may race) and checks it is a writable directory. Usage error naming `flag`, the path and the reason when
// it cannot be created.
void make_writable_dir(const std::string& flag, const std::string& dir);

// Usage error naming `flag` and the path unless it is a readable regular file (io::InputFile opens
// it, without blocking on a FIFO, and closes it again).
void check_readable_file(const std::string& flag, const std::string& path);

// Usage error naming the path when it cannot be written (missing directory, permissions).
void write_file_atomic(const std::string& path, std::string_view bytes);
// The same for several pieces written back to back (no concatenated copy).
void write_file_atomic(const std::string& path, std::initializer_list<std::string_view> pieces);

}  // namespace trn::io
