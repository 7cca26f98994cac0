// The training loop: sampler -> forward/backward (micro-batches) -> gradient sync -> global norm
// clipping -> AdamW, with progress lines, metrics JSONL and the final save.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/data/data.h"
#include "runtime/model/gpt.h"
#include "runtime/optim/adamw.h"
#include "runtime/train/grad_sync.h"
#include "runtime/train/options.h"

namespace trn::train {

struct StepStats {
  int64_t step = 0;  // 1-based
  double loss = 0.0;
  float lr = 0.0f;
  double grad_norm = 0.0;  // before clipping
  double tokens_per_s = 0.0;
  double elapsed_s = 0.0;  // since the first step started
};

class Trainer {
 public:
  // sync may be null (one process); it must outlive the trainer.
  Trainer(const Options& opt, GradientSync* sync = nullptr);
  ~Trainer();

  model::Gpt& model() { return *model_; }
  const data::Tokens& tokens() const { return tokens_; }
  // Runs one optimizer step (the next one) and returns its figures.
  StepStats step();
  // Runs all remaining steps with logging, then saves (rank 0).
  void run();
  void save(const std::string& path) const;

  // Called on every rank after each step of run() (heartbeats, progress reports).
  std::function<void(const StepStats&)> on_step;

 private:
  void dump_batches(const std::string& path) const;
  void write_metrics(const StepStats& s);

  Options opt_;
  GradientSync* sync_;
  int dp_rank_ = 0;
  data::Tokens tokens_;
  std::unique_ptr<data::Sampler> sampler_;
  std::unique_ptr<model::Gpt> model_;
  std::unique_ptr<optim::AdamW> adamw_;
  optim::Schedule schedule_;
  std::vector<int32_t> inputs_, targets_;
  int64_t next_step_ = 0;
  double elapsed_s_ = 0.0;
  std::FILE* metrics_ = nullptr;
};

}  // namespace trn::train
