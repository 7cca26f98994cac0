// Helpers for tests that launch training jobs: launcher command lines, the losses of a
// --metrics-jsonl file, counting lines of output, a file's bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/process.h"

namespace trn::test {

// trnrun --nproc-per-node N [opts...] -- program...
inline std::vector<std::string> trnrun_cmd(int nproc, const std::vector<std::string>& program,
                                           const std::vector<std::string>& opts = {}) {
  std::vector<std::string> c = {bin("trnrun"), "--nproc-per-node", std::to_string(nproc)};
  c.insert(c.end(), opts.begin(), opts.end());
  c.push_back("--");
  c.insert(c.end(), program.begin(), program.end());
  return c;
}

// mpirun (as root, oversubscribed) -np N program...
inline std::vector<std::string> mpirun_cmd(int nproc, const std::vector<std::string>& program) {
  std::vector<std::string> c = {"mpirun", "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(nproc)};
  c.insert(c.end(), program.begin(), program.end());
  return c;
}

// The "loss" of every line of a --metrics-jsonl file that has one, in order.
inline std::vector<double> jsonl_losses(const std::string& jsonl) {
  std::ifstream f(jsonl);
  std::vector<double> out;
  std::string line;
  const std::regex re("\"loss\": ([-0-9.eE+]+)");
  while (std::getline(f, line)) {
    std::smatch m;
    if (std::regex_search(line, m, re)) out.push_back(std::stod(m[1]));
  }
  return out;
}

// The lines of a --metrics-jsonl file without their timings: from "step" through the gradient
// norm (step, loss, lr, grad_norm), in order; two runs that computed the same agree on them.
inline std::vector<std::string> jsonl_figures(const std::string& jsonl) {
  std::ifstream f(jsonl);
  std::vector<std::string> out;
  const std::regex re("(\"step\".*\"grad_norm\": [-0-9.eE+]+)");
  std::smatch m;
  for (std::string line; std::getline(f, line);)
    if (std::regex_search(line, m, re)) out.push_back(m[1]);
  return out;
}

// How many lines of a program's output contain `what`.
inline size_t count_lines_with(const std::string& text, const std::string& what) {
  size_t n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) n += line.find(what) != std::string::npos;
  return n;
}

// The newest "step N/" a progress line of a trn-train's output reports (0: none yet).
inline int64_t newest_step(const std::string& output) {
  int64_t best = 0;
  static const std::regex re(R"(step (\d+)/\d+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re); it != std::sregex_iterator(); ++it)
    best = std::max<int64_t>(best, std::stoll((*it)[1]));
  return best;
}

inline std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace trn::test
