#include "launcher/agent/binding.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>

#include "collectives/core/error.h"

namespace trn::launch {

std::vector<int> allowed_cpus() {
  // A mask as large as the kernel's: CPU_ALLOC sizes grow until sched_getaffinity accepts one.
  for (int n = CPU_SETSIZE;; n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    const size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c)
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      CPU_FREE(set);
      return cpus;
    }
    const int e = errno;
    CPU_FREE(set);
    if (e != EINVAL || n >= (1 << 20)) throw internal_error("sched_getaffinity failed: {}", std::strerror(e));
  }
}

std::vector<int> core_keys(const std::vector<int>& cpus) {
  std::vector<int> keys;
  for (int c : cpus) {
    std::ifstream in("/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/thread_siblings_list");
    int first = -1;
    // The list is in increasing order ("0,64" or "0-1"): its first number is the lowest sibling.
    keys.push_back(in >> first && first >= 0 ? first : c);
  }
  return keys;
}

std::vector<std::vector<int>> split_cpus(const std::vector<int>& cpus, const std::vector<int>& core_of, int ranks) {
  TRN_CHECK(cpus.size() == core_of.size() && ranks > 0);
  if (cpus.size() < static_cast<size_t>(ranks)) return {};
  // The cores, ordered by their lowest CPU, each with its CPUs in increasing order.
  std::vector<std::pair<int, int>> by_cpu;  // (cpu, core key)
  for (size_t i = 0; i < cpus.size(); ++i) by_cpu.emplace_back(cpus[i], core_of[i]);
  std::sort(by_cpu.begin(), by_cpu.end());
  std::map<int, size_t> index;  // core key -> position in cores
  std::vector<std::vector<int>> cores;
  for (auto [cpu, key] : by_cpu) {
    auto [it, fresh] = index.emplace(key, cores.size());
    if (fresh) cores.emplace_back();
    cores[it->second].push_back(cpu);
  }
  // Units dealt out in contiguous blocks: whole cores when there are enough, else single CPUs.
  std::vector<std::vector<int>> units;
  if (cores.size() >= static_cast<size_t>(ranks)) {
    units = std::move(cores);
  } else {
    for (const auto& core : cores)
      for (int cpu : core) units.push_back({cpu});
  }
  std::vector<std::vector<int>> sets(ranks);
  const size_t n = units.size();
  for (int r = 0; r < ranks; ++r) {
    for (size_t u = n * r / ranks; u < n * (r + 1) / ranks; ++u)
      sets[r].insert(sets[r].end(), units[u].begin(), units[u].end());
    std::sort(sets[r].begin(), sets[r].end());
  }
  return sets;
}

std::vector<std::vector<int>> plan_binding(Bind bind, int ranks) {
  if (bind == Bind::kNone) return {};
  const std::vector<int> cpus = allowed_cpus();
  if (cpus.size() < static_cast<size_t>(ranks)) {
    if (bind == Bind::kCore)
      throw usage_error("--bind core: {} workers need at least as many CPUs, but trnrun may run on {} ({}); give "
                        "fewer workers, more CPUs, or --bind none",
                        ranks, cpus.size(), format_cpu_list(cpus));
    return {};
  }
  return split_cpus(cpus, core_keys(cpus), ranks);
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(cpus[i]) : std::to_string(cpus[i]) + "-" + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace trn::launch
