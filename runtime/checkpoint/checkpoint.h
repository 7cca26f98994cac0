// Sharded checkpoints (DESIGN.md "Checkpoints"): DIR/step-<8 digits>/ holds one shard file per
// model-parallel rank of data-parallel replica 0 (replicas hold the same state) and a manifest
// written last, atomically, once every shard is durable: the commit marker. A directory without
// a manifest does not exist for readers and is removed.
//
// A shard file: 8-byte little-endian header length, a JSON header (format, version, rank, and per
// tensor: HF name, global shape, the slice this rank holds (dimension, offset, length,
// interleave), its element count, its byte offset in the data and an XXH64 of each of its three
// arrays), then the data: per tensor its parameters, AdamW's first and second moments (f32).
// The manifest (manifest.json): format, version, step, layout, model, optimizer step, seed, and
// every shard file's name, size and XXH64; from version 3 also the run it belongs to ("run_id")
// and the training settings that must not change on a resume ("settings": flag -> value).
//
// Contract: verify() and load() run one validation (check() in checkpoint.cc): every field of
// the manifest and of each shard header has its type and range checked before use, every file
// its size and XXH64, every tensor entry its hashes and bounds, and every global element of
// every tensor of the model must be covered. What verify passes, load loads; what fails is a
// usage error "damaged checkpoint FILE: ..." naming the file and the field.
//
// Every tensor is a slice of a global tensor, so a checkpoint of any layout loads into any other:
// each rank assembles the global tensors it holds from the shards that cover them.
//
// Under ZeRO-1 (version 2) every rank of every replica writes a shard: the parameters and AdamW
// moments of the elements it owns (optim/zero.h), which are ranges of its flat buffer. Where a
// range meets a tensor the shard holds one entry, its local slice as above plus "range": [b, e),
// the elements b..e-1 of that slice in its row-major order. An entry is thus still a set of
// global elements named exactly, so loading reshards bit for bit into any layout, with or
// without ZeRO, and every global element must be covered by the shards.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/model/config.h"
#include "runtime/optim/zero.h"
#include "runtime/parallel/grid.h"
#include "runtime/parallel/plan.h"

namespace trn {
class Communicator;
}

namespace trn::checkpoint {

struct State {
  int64_t step = 0;            // steps done: training resumes at this step
  int64_t optimizer_step = 0;  // AdamW's t
  uint64_t seed = 0;
  // The run the checkpoint belongs to; empty for checkpoints written before run ids (they count
  // as another run's).
  std::string run_id;
  // The settings a resume must match, as flag and value ("--lr", "0.001"), in a fixed order.
  // Older checkpoints record only --seed.
  std::vector<std::pair<std::string, std::string>> settings;
};

// The elements whose state a rank's arrays hold, as ascending ranges of its parameter buffer,
// kept one range after another (a ZeRO-1 shard). Null stands for the whole buffer.
using Owned = std::vector<optim::Range>;

std::string step_dir(const std::string& dir, int64_t step);  // DIR/step-00000042

// Collective over world (null: alone). Ranks of replica 0 write their shard of params and the
// AdamW moments m and v (lay's buffer order) into step_dir; the manifest records the plan's
// grid and virtual stages (its "layout"); with owned (ZeRO-1) every rank
// writes the elements it owns, and params, m and v hold those only, in owned order. Then rank 0
// writes the manifest
// and keeps the newest `keep` committed checkpoints, removing older ones and uncommitted
// directories. Returns the committed directory.
// report, when set, is called on every rank once its shard is durable (bytes 0 and the step
// directory for the path: this rank of a
// replica past the first wrote none), before the barrier that precedes the manifest: it tells
// the coordinator's shard registry (ReportShard), which commits the step once every rank did.
using ReportFn = std::function<void(int64_t step, const std::string& path, uint64_t bytes)>;
std::string save(const std::string& dir, const State& st, const parallel::Plan& plan, const model::ParamLayout& lay,
                 const float* params, const float* m, const float* v, const parallel::Coords& me,
                 const std::shared_ptr<Communicator>& world, int keep, const ReportFn& report = {},
                 const Owned* owned = nullptr);

// The newest committed checkpoint under dir that passes verify(), skipping bad ones with a
// warning naming the file and field; with run_id, only checkpoints of that run count (others
// are passed over without a word). nullopt when there is none.
std::optional<std::string> latest(const std::string& dir, const std::string* run_id = nullptr);

// The newest step directory under dir holding a manifest (committed, whether or not it checks
// out); nullopt when there is none.
std::optional<std::string> newest_committed(const std::string& dir);

// Usage error naming what is wrong unless path is a checkpoint that load() can load: the same
// validation load runs. Returns its state.
State verify(const std::string& path);

// An exclusive lock on a checkpoint directory (flock on DIR/.lock) held for a run's lifetime by
// its global rank 0, with the holder's host, pid and run id written in the file. The kernel
// releases it when the holder dies, so a restarted job's new rank 0 can take it.
class DirLock {
 public:
  // Usage error naming the holder when another process holds the lock. A holder of the same run
  // (a previous generation's rank 0 still exiting) is waited for up to wait_same_run_s.
  DirLock(const std::string& dir, const std::string& run_id, double wait_same_run_s = 30.0);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

// Fills this rank's params (its whole ParamLayout buffer, or with params_storage kCompact only
// the owned elements in owned order: ZeRO-3), m and v (the whole buffer, or with owned only
// those elements, in owned order) from the checkpoint at path, whatever layout and ZeRO setting
// saved it, and returns its state. Usage error when the model differs, a file is damaged or the
// shards leave an element uncovered.
State load(const std::string& path, const model::ParamLayout& lay, float* params, float* m, float* v,
           const Owned* owned = nullptr, optim::Storage params_storage = optim::Storage::kWhole);

// What `trn-ckpt ls` shows of one step directory.
struct Entry {
  std::string path;
  int64_t step = 0;
  bool committed = false;
  std::string model, layout;  // from the manifest ("dp 1 x tp 2 x pp 2 (virtual stages 1)", ", zero 1" after)
  uint64_t bytes = 0;         // the shard files' sizes
};
std::vector<Entry> list(const std::string& dir);

// The model a committed checkpoint holds (parsed from its manifest).
model::Config model_of(const std::string& path);

}  // namespace trn::checkpoint
