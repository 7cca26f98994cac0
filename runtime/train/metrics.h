// One step's figures, and --metrics-jsonl: one JSON object per line, flushed as written. A line
// that cannot be written whole (a full disk) stops the run: metrics are part of its result, and
// a cut line would break every reader of the file.
//
// A step followed by a validation carries it on its own line: "val_loss" (the mean token loss
// over the held-out batches) and "val_ppl" (its exp); steps without one have neither field.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace trn::train {

struct StepStats {
  int64_t step = 0;  // 1-based
  double loss = 0.0;
  float lr = 0.0f;
  double grad_norm = 0.0;  // before clipping
  double tokens_per_s = 0.0;
  double elapsed_s = 0.0;  // since the first step started
  double checkpoint_blocked_s = -1.0;  // the step's wait for its checkpoint; < 0: none taken
  double val_loss = -1.0;  // the validation after this step (Trainer::evaluate); < 0: none ran
  // MoE: the balancing loss (mean over the batch's sequences of its sum over layers; the loss
  // trained is loss + moe_aux_coef x aux_loss); < 0: a dense model.
  double aux_loss = -1.0;
  // MoE, per layer: the most tokens an expert took over the mean (1: balanced), the experts that
  // took none, and the step's choices the capacity dropped (all layers).
  std::vector<double> moe_max_mean;
  std::vector<int> moe_dead;
  double moe_dropped = 0;
  // --metrics-moe-loads: each layer's kept choices per expert over the global batch, n_layer rows
  // of n_experts ("moe_loads", a list per layer); empty: not written.
  std::vector<std::vector<double>> moe_loads;
};

// The largest step of path's step lines (MetricsFile::write), 0 when it has none, -1 when it
// cannot be read (no file). A line cut short by a kill is not counted.
int64_t last_metrics_step(const std::string& path);

class MetricsFile {
 public:
  MetricsFile() = default;
  // Opens path (--metrics-jsonl), appending when a resumed run continues it: usage error when
  // it cannot be written.
  MetricsFile(const std::string& path, bool append);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;
  MetricsFile(MetricsFile&& other) noexcept;
  MetricsFile& operator=(MetricsFile&& other) noexcept;

  // No-ops on a file never opened.
  void write(const StepStats& s);
  void write_line(const std::string& json);

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace trn::train
