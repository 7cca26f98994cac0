// Binding a node's workers to CPUs (trnrun --bind). With core, local rank l runs on its own share
// of the CPUs trnrun itself may run on, disjoint from every other local rank's, as mpirun
// --bind-to core places its ranks. Left to the OS, two ranks of a host can share one core for a
// whole launch while another core idles, and a rank waiting on the fabric then competes with the
// peer it waits for (small all-reduces 5-20x slower: bench/results/2026-12-07-all-to-all-v.md).
//
// The shares come from trnrun's own affinity mask, so a mask set around trnrun (taskset, Slurm's
// --cpu-bind, a container's cpuset) is divided, never widened.
#pragma once

#include <string>
#include <vector>

namespace trn::launch {

// kAuto: core when trnrun may run on at least as many CPUs as the node has workers, none
// otherwise (the default). kCore: core, and a usage error when there are too few CPUs.
enum class Bind { kAuto, kCore, kNone };

// The CPUs this process may run on (sched_getaffinity), in increasing order.
std::vector<int> allowed_cpus();

// A key per CPU of cpus, equal for the hardware threads of one core: the lowest CPU of its
// thread_siblings_list in sysfs (the CPU itself when sysfs does not say).
std::vector<int> core_keys(const std::vector<int>& cpus);

// Splits cpus (core_of[i]: cpus[i]'s core key) into `ranks` disjoint non-empty sets, each in
// increasing order. With at least as many cores as ranks, each rank gets whole cores, in
// contiguous blocks of the cores ordered by their lowest CPU (hardware threads stay with their
// core); with fewer cores, single CPUs, siblings next to each other. Empty when cpus has fewer
// CPUs than ranks.
std::vector<std::vector<int>> split_cpus(const std::vector<int>& cpus, const std::vector<int>& core_of, int ranks);

// Each local rank's CPU set under bind for a node of `ranks` workers, from this process's
// affinity mask; empty (workers inherit trnrun's mask) under none, and under auto when there are
// fewer CPUs than ranks. Under core with fewer CPUs than ranks: a usage error.
std::vector<std::vector<int>> plan_binding(Bind bind, int ranks);

// "0-3,8,10-11"; "" for no CPUs.
std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace trn::launch
