// In-memory snapshots (--snapshot-every N): the state a rank needs to go on from a step (its
// parameters, AdamW's moments and update count, the step) kept in its own memory and in a
// buddy's, so that after a failure the job resumes from memory instead of disk, and only the
// replaced process receives its state, over the fabric from the rank that holds it.
//
// What a snapshot holds: the whole parameter buffer of this rank, the optimizer's moments of the
// elements it keeps (optim::Optimizer::m/v, all of them without ZeRO) and its update count. The
// data position and the RNG need nothing: the batch of step s is a pure function of (seed, s).
//
// Own copies: the two newest snapshot steps, copied synchronously on the training thread after
// the optimizer update (take()). Two, because a failure can leave ranks one step apart (every
// step has a collective over the whole world, the loss and gradient norm, so no rank can finish
// step s + 2 before every rank finished step s + 1), and recovery needs a step every rank has.
//
// Buddies (buddy_map): the rank whose memory holds a second copy of rank r's state.
//  - Mirrored: with dp > 1 and no ZeRO, r's data-parallel replicas hold bit-identical state, so a
//    replica's own snapshot is r's copy and nothing is sent. The holder is the next replica
//    (dp index + 1, cyclically) on another host, or the next replica when all share r's host.
//  - Sent: otherwise (dp 1, or ZeRO-1, whose moments differ per replica) the holder is the rank
//    one host further on with the same local position (r + ranks per host, mod world), or r + 1
//    on a single host. Each rank sends its snapshot to its holder and receives its ward's,
//    asynchronously on a communicator of its own, overlapping the next step; the next take()
//    waits for it (the blocked time is its cost) and the copy counts only once complete.
// A host and its buddy lost together, or the whole job, leave disk checkpoints as the durable tier.
//
// Recovery (restore()): every rank of the new generation says which steps it holds (its own,
// and its ward's copies); the newest step for which every rank's state is held somewhere wins,
// each rank without it receives it from its provider, and everything is loaded. Deterministic:
// every rank computes the same plan from the same gathered table.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives/communicator.h"
#include "runtime/model/model.h"
#include "runtime/optim/optimizer.h"
#include "runtime/parallel/grid.h"

namespace trn::train {

struct BuddyMap {
  std::vector<int> holder;  // holder[r]: the rank keeping r's second copy (-1: none, a world of one)
  bool mirrored = false;    // holders are replicas whose own snapshots equal r's: nothing is sent
  // The rank whose copy r keeps (-1: none).
  int ward(int r) const;
};

// host_of[r]: any value naming rank r's host. zero: ZeRO-1 shards the optimizer state.
BuddyMap buddy_map(const parallel::GridShape& shape, const std::vector<int64_t>& host_of, bool zero);

// One rank's state after `step` steps.
struct SnapshotState {
  int64_t step = -1;  // -1: empty (or a copy not yet complete)
  int64_t optimizer_steps = 0;
  std::vector<float> params, m, v;
};

// Which state a rank of `shape` keeps (state_key): its (tp, pp) shard, which every data-parallel
// replica holds alike, or under ZeRO-1 with dp > 1 (moments split over the replicas) the rank
// itself in a grid of that dp. Equal keys mean interchangeable snapshots, also across a change
// of dp (elastic jobs) where the state does not depend on dp.
int64_t state_key(const parallel::GridShape& shape, int rank, bool zero);

// What each rank holds, as gathered at recovery: steps of its own two snapshots and the key of
// their state, and steps of the two copies it keeps for its ward (-1: none).
struct HeldSteps {
  int64_t own[2] = {-1, -1};
  int64_t copy[2] = {-1, -1};
  int64_t key = -1;
  // The newest step the run may go on from, -1 for any: the metrics writer's last line
  // (restore's `bound`). A replica can finish a step whose collective failed on rank 0 after it,
  // so the newest step held can be one whose line rank 0 never wrote.
  int64_t bound = -1;
};

// The recovery plan: the step every rank goes on from, and for each rank that lacks its own
// snapshot of it, the rank that sends it (and whether from its copy slot, or its own snapshot).
struct RestorePlan {
  int64_t step = -1;  // -1: no step is held for every rank
  struct Transfer {
    int to, from;
    bool from_copy;  // the provider sends its ward copy (else its own snapshot: a mirrored replica)
  };
  std::vector<Transfer> transfers;
  std::string why_none;  // when step is -1: which rank's state is missing
};
// shape, buddies, zero: the new generation's grid. A rank has the state it needs when its own
// snapshot has its key; otherwise any rank whose own snapshot has that key sends it, or else its
// holder sends the copy it keeps (copies are published only within an unchanged grid). No step
// above a rank's bound is chosen.
RestorePlan plan_restore(const parallel::GridShape& shape, const BuddyMap& buddies, const std::vector<HeldSteps>& held,
                         bool zero);

class Snapshots {
 public:
  explicit Snapshots(int64_t every) : every_(every) {}
  ~Snapshots();
  Snapshots(const Snapshots&) = delete;
  Snapshots& operator=(const Snapshots&) = delete;

  int64_t every() const { return every_; }
  // Binds to a generation's grid: the buddy map (hosts gathered over the world), a communicator
  // of its own, and the sizes of every rank's state. Collective over the world.
  void attach(const parallel::ProcessGrid& grid, bool zero, const model::LocalModel& model,
              const optim::Optimizer& optimizer);
  // Lets go of the generation: transfers in flight are abandoned (their copies stay incomplete).
  void detach();
  // After step `step` when it is due (step % every == 0): waits for the previous transfer, copies
  // this rank's state into the older slot, and posts its transfer to the holder.
  void take(int64_t step, const model::LocalModel& model, const optim::Optimizer& optimizer);
  // Collective over the world (after attach): loads the newest step held for every rank, and at
  // most any rank's bound (-1: none), into model and optimizer and returns it; nullopt when none
  // is (a fresh start, or state lost with a host and its buddy). Afterwards every holder keeps a
  // copy of that step again.
  std::optional<int64_t> restore(model::LocalModel& model, optim::Optimizer& optimizer, int64_t bound = -1);

  // Seconds take() blocked (copy and waiting for the previous transfer), snapshots taken and bytes
  // sent to holders, since the start.
  double blocked_s() const { return blocked_s_; }
  int64_t taken() const { return taken_; }
  uint64_t bytes_sent() const { return bytes_sent_; }
  const BuddyMap& buddies() const { return buddies_; }

 private:
  struct Sizes {
    int64_t params = 0, m = 0, v = 0;
  };
  HeldSteps held() const;
  void finish_transfer();  // waits for the transfer in flight, if any
  void post_send(const SnapshotState& s, int to);
  void post_recv(SnapshotState& s, const Sizes& sizes, int from);

  int64_t every_;
  SnapshotState own_[2], copy_[2];
  std::shared_ptr<Communicator> comm_;  // the snapshots' own, split from the world
  parallel::GridShape shape_;
  bool zero_ = false;
  int rank_ = 0;
  // The grid the own snapshots were taken in: their state's key, and the world size (copies
  // count only in the same grid).
  int64_t own_key_ = -1;
  int own_world_ = 0;
  BuddyMap buddies_;
  std::vector<Sizes> sizes_;  // every rank's state sizes
  // The transfer in flight: handles, the copy slot being received and the step it will hold.
  std::vector<WorkPtr> pending_recv_, pending_send_;
  int64_t header_out_[2] = {-1, 0}, header_in_[2] = {-1, 0};
  int pending_copy_ = -1;
  double blocked_s_ = 0;
  int64_t taken_ = 0;
  uint64_t bytes_sent_ = 0;
};

}  // namespace trn::train
