#include "runtime/train/metrics.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "collectives/core/error.h"

namespace trn::train {

MetricsFile::MetricsFile(const std::string& path, bool append)
    : path_(path), f_(std::fopen(path.c_str(), append ? "a" : "w")) {
  if (!f_) throw usage_error("cannot write --metrics-jsonl {}: {}", path_, std::strerror(errno));
}

MetricsFile::~MetricsFile() {
  if (f_) std::fclose(f_);
}

MetricsFile::MetricsFile(MetricsFile&& other) noexcept
    : path_(std::move(other.path_)), f_(std::exchange(other.f_, nullptr)) {}

MetricsFile& MetricsFile::operator=(MetricsFile&& other) noexcept {
  if (this != &other) {
    if (f_) std::fclose(f_);
    path_ = std::move(other.path_);
    f_ = std::exchange(other.f_, nullptr);
  }
  return *this;
}

namespace {

// ", \"moe_loads\": [[...], ...]" (--metrics-moe-loads), or nothing.
std::string moe_loads(const std::vector<std::vector<double>>& loads) {
  if (loads.empty()) return "";
  std::string out = ", \"moe_loads\": [";
  for (size_t l = 0; l < loads.size(); ++l)
    out += fmt::format("{}[{:.0f}]", l ? ", " : "", fmt::join(loads[l], ", "));
  return out + "]";
}

}  // namespace

void MetricsFile::write(const StepStats& s) {
  if (!f_) return;
  const std::string line = fmt::format(
      "{{\"step\": {}, \"loss\": {:.9g}, \"lr\": {:.9g}, \"grad_norm\": {:.9g}, "
      "\"tokens_per_s\": {:.1f}, \"elapsed_s\": {:.6f}{}{}{}}}\n",
      s.step, s.loss, s.lr, s.grad_norm, s.tokens_per_s, s.elapsed_s,
      s.aux_loss >= 0 ? fmt::format(", \"aux_loss\": {:.9g}, \"moe_max_mean\": [{:.6g}], \"moe_dead\": [{}], "
                                    "\"moe_dropped\": {:.0f}",
                                    s.aux_loss, fmt::join(s.moe_max_mean, ", "), fmt::join(s.moe_dead, ", "),
                                    s.moe_dropped) +
                            moe_loads(s.moe_loads)
                      : "",
      s.checkpoint_blocked_s >= 0 ? fmt::format(", \"checkpoint_blocked_s\": {:.6f}", s.checkpoint_blocked_s)
                                  : "",
      s.val_loss >= 0
          ? fmt::format(", \"val_loss\": {:.9g}, \"val_ppl\": {:.9g}", s.val_loss, std::exp(s.val_loss))
          : "");
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    throw usage_error("cannot write --metrics-jsonl {} at step {}: {}", path_, s.step, std::strerror(errno));
}

int64_t last_metrics_step(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return -1;
  int64_t last = 0;
  std::string line;
  for (int c; (c = std::fgetc(f)) != EOF;) {
    if (c != '\n') {
      line.push_back(char(c));
      continue;
    }
    long long step = 0;
    int used = 0;
    if (std::sscanf(line.c_str(), "{\"step\": %lld,%n", &step, &used) == 1 && used > 0) last = std::max<int64_t>(last, step);
    line.clear();
  }
  std::fclose(f);
  return last;
}

void MetricsFile::write_line(const std::string& json) {
  if (!f_) return;
  const std::string line = json + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    throw usage_error("cannot write --metrics-jsonl {}: {}", path_, std::strerror(errno));
}

}  // namespace trn::train
