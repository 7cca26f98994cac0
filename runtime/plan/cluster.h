// What trn-plan plans for: a cluster description (deploy/clusters/*.json, the published figures
// of an instance type with their sources) or this machine's own, measured by `trn-plan calibrate`
// (a local cluster file: the real Stage bodies timed at a model's shapes, the process's base
// memory, and the host's cores and memory).
//
//   trn1.32xlarge:N     N nodes of deploy/clusters/trn1.32xlarge.json (ranks_per_node each)
//   local:FILE          FILE as calibrate wrote it; its "hosts" (default 1) hold the job's ranks
//                       evenly, "hosts_share_cores" says they are a test bed on one machine (its
//                       cpu_cores are all of theirs), and "inter_node" "delay_us" adds a one-way
//                       delay between hosts
#pragma once

#include <map>
#include <string>
#include <vector>

#include "collectives/cost_model.h"
#include "collectives/fp8.h"

namespace trn::plan {

// One tensor-parallel call of a piece's bodies: its elements (the whole message, every rank's part
// for sequence parallelism's all-gather or reduce-scatter) and whether it is one of those, which
// move half of what an all-reduce of as many elements moves (a ring's (tp-1)/tp of the message
// against twice that).
struct TpCall {
  size_t n = 0;
  bool half = false;
  bool operator==(const TpCall&) const = default;
};

// Seconds per micro-batch of each piece of a model, measured at one (tp, micro-batch size).
struct PieceTimes {
  double embedding_fwd = 0, embedding_bwd = 0;
  double block_fwd = 0, block_bwd = 0, block_bwd_input = 0, block_bwd_weight = 0;
  double head_fwd = 0, head_bwd = 0;
  PieceTimes scaled(double f) const {
    return {embedding_fwd * f,   embedding_bwd * f,    block_fwd * f, block_bwd * f,
            block_bwd_input * f, block_bwd_weight * f, head_fwd * f,  head_bwd * f};
  }
};

// `trn-plan calibrate`'s measurements for one model, sequence length and precision, on one
// compute thread per rank.
struct Calibration {
  std::string model;      // model::Config::describe() (precision aside)
  std::string precision;  // fp32 | bf16
  int seq_len = 0;
  std::string cpu;  // the CPU it was measured on
  // [tp][micro-batch size] -> times; sizes are powers of two, interpolated linearly between.
  std::map<int, std::map<int, PieceTimes>> pieces;
  double adamw_s_per_param = 0;  // AdamW's update, per parameter, one thread
  double norm_s_per_param = 0;   // the gradient norm's sum of squares, per parameter
  double copy_bytes_per_s = 0;   // a large memcpy (snapshots)
  // A worker's resident memory beyond what the plan counts: a rank of a job whose peers are on
  // its host, one with peers on other hosts (the network provider's buffers), a process alone.
  double base_rss_bytes = 0, base_rss_network_bytes = 0, base_rss_single_bytes = 0;
  // Real steps against the pieces (measured when calibrate has trn-train; else 1). step_scale: a
  // one-process trn-train step over the pieces' prediction of the same step (a step streams the
  // optimizer's state and the data between the passes, which the pieces, timed in a loop, do
  // not); at() applies it. busy_scale: that step with every core running one at once over the
  // step alone (the cores' shared caches, memory bandwidth and frequency); the plan applies it
  // where ranks share the cores.
  double step_scale = 1, busy_scale = 1;
  // ZeRO-3 beside its compute on CPU cores (measured when calibrate has trn-train; else 1): a
  // 2-rank --zero 3 step over the same --dp 2 step, measured, over the same ratio as the plan
  // predicts it. What the gathers cost beyond the waits the plan counts (the engine's copies and
  // wake-ups on the cores the compute runs on); the plan scales a ZeRO-3 rank's compute by it.
  double zero3_scale = 1;
  // Ranks of one job on a host's cores (measured when calibrate has trn-train; else 1): a 2-rank
  // --dp 2 step, measured, less the plan's other terms, over the plan's compute of it (which
  // busy_scale already scales). What the ranks' compute costs beyond the pieces running at
  // once: each step's wait for the slower rank when the cores' threads are time-sliced, the
  // engines' threads on the same cores. The plan scales the compute of every layout whose ranks
  // share a host's cores on a local cluster by it.
  double ranks_scale = 1;
  // A ring step's latency over shm with twice as many ranks as cores, each running work between
  // its calls (probe-link): the wait for a neighbour the cores are not running. 0: not measured.
  // The plan charges it beyond the links' alpha to the messages of a host whose ranks outnumber
  // its cores that the ranks wait for.
  double oversubscribed_alpha_us = 0;
  // The same with each call issued before the work and waited for after it (probe-link
  // --behind): a step's hidden collectives (data-parallel buckets, ZeRO-3's prefetched gathers,
  // context parallelism's ring, pipeline sends), whose ring steps wait for a peer's engine thread
  // to get a core from the ranks' compute. 0: not measured. The plan charges the larger of the
  // two to those collectives' messages where ranks outnumber cores.
  double oversubscribed_behind_alpha_us = 0;
  // The links measured between 2 ranks of this host (shm, and tcp as between hosts), when
  // links_measured; else the transports' stated figures.
  CostParams intra = params_for_transport("shm"), inter = params_for_transport("tcp");
  bool links_measured = false;
  // Times for (tp, batch), interpolated (or extrapolated) in the batch; empty when tp was not measured.
  bool has_tp(int tp) const { return pieces.count(tp) > 0; }
  PieceTimes at(int tp, int batch) const;
};

struct Cluster {
  std::string name;        // "trn2.48xlarge", "local"
  std::string source;      // the file it came from
  bool local = false;      // compute from the calibration; else from the device rates
  int nodes = 1;           // hosts
  int ranks_per_node = 0;  // 0: the job's ranks spread evenly over the nodes (local)
  int cpu_cores = 1;
  bool hosts_share_cores = false;  // local: the hosts are a test bed on one machine's cores
  double host_memory_bytes = 0;
  double device_memory_bytes = 0;  // per rank; 0: ranks live in host memory (CPU workers)
  // Device rates (per rank): dense matmul peaks, the share a large GEMM sustains, memory
  // bandwidth, and a fixed cost per kernel.
  double matmul_flops_fp32 = 0, matmul_flops_bf16 = 0, matmul_efficiency = 1;
  double memory_bytes_per_s = 0, launch_overhead_s = 0;
  // Links: intra (the ranks of one node) and inter (between nodes), as the collectives' model.
  CostModel links;
  // Intra-node collectives are an alpha-beta link (NeuronLink: per-hop latency, the bandwidth of
  // half a chip's links each way); the torus's dims in the file do not shape the rings.
  double hop_latency_s = 0;
  int rails = 1;
  double node_bytes_per_s = 0;       // inter-node bandwidth of a node, all rails
  double delay_s = 0;                // extra one-way delay between nodes
  double storage_bytes_per_s = 1e9;  // checkpoint writes per rank
  // The E4M3 format the devices take for --grad-comm fp8 (the file's "device.fp8_format": "ocp"
  // or "neuron"; ocp when absent and for local clusters, whose CPUs take either).
  Fp8Format fp8_format = Fp8Format::kOCP;
  Calibration calibration;           // local only

  int world() const { return ranks_per_node > 0 ? nodes * ranks_per_node : 0; }
  // Ranks per node for a job of `world` ranks.
  int per_node(int world) const { return ranks_per_node > 0 ? ranks_per_node : (world + nodes - 1) / nodes; }
  // Memory one rank may use.
  double rank_memory(int world) const;
};

// "trn2.48xlarge:N" (a file of the cluster directory) or "local:FILE"; a usage error naming the
// problem for a bad spec, a missing or malformed file. dir: where the cluster files are.
Cluster load_cluster(const std::string& spec, const std::string& dir);
// The directory of cluster files: TRN_CLUSTERS, else the installed share/trn/clusters next to the
// program, else the source tree's deploy/clusters.
std::string clusters_dir(const std::string& program_path);
// The names of the cluster files there ("trn1.32xlarge", ...).
std::vector<std::string> cluster_names(const std::string& dir);

// Writes a local cluster file (atomically): this host's cores and memory, the transports' cost
// parameters, and the calibration.
void save_local_cluster(const std::string& path, const Calibration& cal, int cpu_cores, double memory_bytes);

}  // namespace trn::plan
