#include "collectives/cost_model.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <map>

#include "collectives/algorithms/algorithm.h"
#include "collectives/core/error.h"

namespace trn {

const char* to_string(Algo a) {
  switch (a) {
    case Algo::kAuto: return "auto";
    case Algo::kRing: return "ring";
    case Algo::kTree: return "tree";
    case Algo::kRhd: return "rhd";
    case Algo::kHier: return "hier";
  }
  return "?";
}

Algo parse_algo(std::string_view name) {
  if (name == "auto") return Algo::kAuto;
  if (name == "ring") return Algo::kRing;
  if (name == "tree") return Algo::kTree;
  if (name == "rhd") return Algo::kRhd;
  if (name == "hier") return Algo::kHier;
  throw usage_error("unknown algorithm '{}' (use ring, tree, rhd, hier or auto)", name);
}

const char* to_string(A2aAlgo a) {
  switch (a) {
    case A2aAlgo::kAuto: return "auto";
    case A2aAlgo::kPairwise: return "pairwise";
    case A2aAlgo::kDirect: return "direct";
  }
  return "?";
}

A2aAlgo parse_a2a_algo(std::string_view name) {
  if (name == "auto") return A2aAlgo::kAuto;
  if (name == "pairwise") return A2aAlgo::kPairwise;
  if (name == "direct") return A2aAlgo::kDirect;
  throw usage_error("unknown all-to-all algorithm '{}' (use pairwise, direct or auto)", name);
}

CostParams params_for_transport(std::string_view d) {
  CostParams p;
  if (d.find("shm") != std::string_view::npos || d.find("local") != std::string_view::npos) {
    p.alpha_us = 10;
    p.beta_us_per_kib = 0.25;
    p.gamma_us_per_kib = 0.12;
    p.ring_overlap = 0.3;
    // Ring chunks of 256 KiB, however long the segment: the chunks a receiver pulls and reduces
    // stay in cache (bench/results/2026-11-30-shm-ring-chunks.md).
    p.chunk_kib = 256;
  } else if (d.find("efa") != std::string_view::npos) {
    p.alpha_us = 15;
    p.beta_us_per_kib = 0.08;
    p.gamma_us_per_kib = 0.12;
    p.ring_overlap = 0.8;
  } else {  // tcp
    p.alpha_us = 40;
    p.beta_us_per_kib = 0.5;
    p.gamma_us_per_kib = 0.12;
    p.ring_overlap = 0.5;
    // 256 KiB rather than 512: a 1 MiB all-reduce of 2 ranks then pipelines in 2 chunks per
    // segment instead of one (bench/results/2026-11-29-ring-chunks.md).
    p.chunk_kib = 256;
    // A tcp connection is bound by its own copies, not the wire: on the test bed the 2 ranks of
    // a host sending across at once each ran at about a lone connection's speed (hier's large
    // all-reduces on 2 hosts x 2 ranks ran about 1.5x the ring's; modelled unshared 1.4x,
    // shared 1.0x: bench/results/2026-12-01-hierarchical-allreduce.md).
    p.link_shared = 0;
    // All-to-all chunks of 1 MiB over tcp: 256 KiB ones are each an rxm eager message, copied in
    // and out of rxm's buffers, and 4 MiB ones leave a pair's exchange unpipelined; 2 ranks on
    // one quiet host, mean us at 1 / 4 / 16 / 64 MiB per rank: 256 KiB 249 / 1151 / 5705 /
    // 21128, 1 MiB 168 / 1105 / 4580 / 18872, 4 MiB 174 / 1233 / 5184 / 19189
    // (bench/results/2026-12-07-all-to-all-quiet.md). The other providers of this branch (udp,
    // sockets, verbs) keep chunk_kib, which is all that was measured there.
    if (d.find("tcp") != std::string_view::npos) p.a2a_chunk_kib = 1024;
  }
  return p;
}

CostModel model_for_transport(std::string_view d) {
  const std::string_view main = d.substr(0, d.find(" + "));
  CostModel m;
  m.inter = params_for_transport(main);
  // Rails (fabric/rails.h): "N rails ... striped over all" in the description. A host's
  // bandwidth to others is then the sum of its rails', since every large message spreads over
  // all of them.
  if (const size_t at = main.find(" rails "); at != std::string_view::npos &&
                                              main.find("striped over all") != std::string_view::npos) {
    size_t start = at;
    while (start > 0 && std::isdigit(static_cast<unsigned char>(main[start - 1]))) --start;
    int rails = 0;
    std::from_chars(main.data() + start, main.data() + at, rails);
    if (rails > 1) m.inter.beta_us_per_kib /= rails;
  }
  const bool same_host_shm = main.size() < d.size() && d.substr(main.size()).find("shm") != std::string_view::npos;
  m.intra = same_host_shm ? params_for_transport("shm") : m.inter;
  return m;
}

std::string HostLayout::describe() const {
  if (uniform()) return fmt::format("{} host{} x {} rank{}", hosts, hosts == 1 ? "" : "s", per_host, per_host == 1 ? "" : "s");
  std::string parts;
  for (int c : counts) parts += (parts.empty() ? "" : " + ") + std::to_string(c);
  return fmt::format("{} ranks on {} hosts ({})", ranks, hosts, parts);
}

HostLayout host_layout(const std::vector<int>& host_of) {
  HostLayout l;
  l.ranks = static_cast<int>(host_of.size());
  std::map<int, int> index;  // host value -> its position, in order of its lowest member
  for (int h : host_of) {
    auto [it, fresh] = index.emplace(h, static_cast<int>(l.counts.size()));
    if (fresh) l.counts.push_back(0);
    ++l.counts[it->second];
  }
  l.hosts = std::max<int>(1, static_cast<int>(l.counts.size()));
  l.per_host = l.counts.empty() ? 1 : l.counts[0];
  for (int c : l.counts)
    if (c != l.per_host) l.per_host = 0;
  return l;
}

const CostParams& flat_params(const HostLayout& layout, const CostModel& m) {
  return layout.hosts > 1 ? m.inter : m.intra;
}

size_t a2a_chunk_bytes(const CostParams& p) {
  return static_cast<size_t>((p.a2a_chunk_kib > 0 ? p.a2a_chunk_kib : p.chunk_kib) * 1024);
}

size_t ring_chunk_bytes(const CostParams& p, size_t chunk_bytes, size_t segment_bytes) {
  const bool whole = segment_bytes <= static_cast<size_t>(p.ring_unchunked_kib * 1024);
  return whole ? std::max(chunk_bytes, segment_bytes) : chunk_bytes;
}

void to_array(const CostParams& p, double out[kCostParamCount]) {
  out[0] = p.alpha_us;
  out[1] = p.beta_us_per_kib;
  out[2] = p.gamma_us_per_kib;
  out[3] = p.ring_overlap;
  out[4] = p.chunk_kib;
  out[5] = p.ring_unchunked_kib;
  out[6] = p.link_shared;
  out[7] = p.a2a_chunk_kib;
}

CostParams from_array(const double in[kCostParamCount]) {
  CostParams p;
  p.alpha_us = in[0];
  p.beta_us_per_kib = in[1];
  p.gamma_us_per_kib = in[2];
  p.ring_overlap = in[3];
  p.chunk_kib = in[4];
  p.ring_unchunked_kib = in[5];
  p.link_shared = in[6];
  p.a2a_chunk_kib = in[7];
  return p;
}

double allreduce_cost_us(Algo a, int n, size_t bytes, const CostParams& p) {
  if (n <= 1) return 0;
  const double kib = static_cast<double>(bytes) / 1024.0;
  const double frac = static_cast<double>(n - 1) / n;
  switch (a) {
    case Algo::kRing: {
      const size_t chunk = ring_chunk_bytes(p, static_cast<size_t>(p.chunk_kib * 1024), bytes / n);
      const double chunk_kib = static_cast<double>(chunk) / 1024.0;
      const double chunks = std::max(1.0, std::ceil(kib / n / chunk_kib));
      // Each extra chunk costs a quarter message latency per phase, half of it hidden behind
      // the other phase's transfers.
      return 2 * (n - 1) * p.alpha_us + (chunks - 1) * p.alpha_us * 0.25 +
             2 * frac * kib * p.beta_us_per_kib + frac * kib * p.gamma_us_per_kib * (1 - p.ring_overlap);
    }
    case Algo::kRhd: {
      int pw = 1, levels = 0;
      while (pw * 2 <= n) pw *= 2, ++levels;
      const double pf = static_cast<double>(pw - 1) / pw;
      double t = bytes <= rhd_doubling_max_bytes(n, p)  // recursive doubling of whole vectors
                     ? levels * (p.alpha_us + kib * p.beta_us_per_kib + kib * p.gamma_us_per_kib)
                     : 2 * levels * p.alpha_us + 2 * pf * kib * p.beta_us_per_kib + pf * kib * p.gamma_us_per_kib;
      if (pw != n) t += 2 * p.alpha_us + 2 * kib * p.beta_us_per_kib + kib * p.gamma_us_per_kib;
      return t;
    }
    case Algo::kTree: {
      int height = 0;
      while ((2 << height) - 1 < n) ++height;  // balanced tree of n nodes
      const double fill = std::min(p.chunk_kib, kib / 2);
      return 2 * height * (p.alpha_us + fill * p.beta_us_per_kib) + 2 * frac * kib * p.beta_us_per_kib +
             kib * p.gamma_us_per_kib;
    }
    case Algo::kHier:  // a flat world has no hosts to group by: hier is the ring
      return allreduce_cost_us(Algo::kRing, n, bytes, p);
    case Algo::kAuto: break;
  }
  return allreduce_cost_us(choose_allreduce(n, bytes, p), n, bytes, p);
}

namespace {

// The inter-host phase's parameters: the host's per_host ranks send across at once.
CostParams shared_link(const HostLayout& layout, const CostModel& m) {
  CostParams p = m.inter;
  p.beta_us_per_kib *= 1 + p.link_shared * (layout.per_host - 1);
  return p;
}

size_t largest_piece(const HostLayout& layout, size_t bytes) {
  const size_t l = static_cast<size_t>(std::max(layout.per_host, 1));
  return (bytes + l - 1) / l;
}

}  // namespace

Algo hier_cross_algo(const HostLayout& layout, size_t bytes, const CostModel& m) {
  return choose_allreduce(layout.hosts, largest_piece(layout, bytes), shared_link(layout, m));
}

size_t hier_cross_doubling_max_bytes(const HostLayout& layout, const CostModel& m) {
  return rhd_doubling_max_bytes(layout.hosts, shared_link(layout, m));
}

size_t rhd_doubling_max_bytes(int n, const CostParams& p) {
  int pw = 1, levels = 0;
  while (pw * 2 <= n) pw *= 2, ++levels;
  if (levels == 0) return 0;
  // Over B KiB: doubling costs L (alpha + B beta + B gamma), halving 2 L alpha + 2 f B beta +
  // f B gamma with f = (p-1)/p. Doubling is cheaper while L alpha > B (L (beta + gamma) - f (2 beta
  // + gamma)); the bracket is positive for every p (L >= 2 f), so there is one crossover.
  const double f = static_cast<double>(pw - 1) / pw;
  const double per_kib = levels * (p.beta_us_per_kib + p.gamma_us_per_kib) - f * (2 * p.beta_us_per_kib + p.gamma_us_per_kib);
  if (per_kib <= 0) return std::numeric_limits<size_t>::max();
  const double kib = levels * p.alpha_us / per_kib;
  if (!(kib > 0)) return 0;  // a stated alpha of 0, below 0 or NaN: never double
  return kib * 1024 >= static_cast<double>(std::numeric_limits<size_t>::max() / 2)
             ? std::numeric_limits<size_t>::max()
             : static_cast<size_t>(kib * 1024);
}

double allreduce_cost_us(Algo a, const HostLayout& layout, size_t bytes, const CostModel& m) {
  if (a == Algo::kAuto) a = choose_allreduce(layout, bytes, m);
  if (a != Algo::kHier) return allreduce_cost_us(a, layout.ranks, bytes, flat_params(layout, m));
  if (!layout.hier_possible()) return std::numeric_limits<double>::infinity();
  const CostParams cross = shared_link(layout, m);
  const size_t piece = largest_piece(layout, bytes);
  return allreduce_cost_us(Algo::kRing, layout.per_host, bytes, m.intra) +
         allreduce_cost_us(choose_allreduce(layout.hosts, piece, cross), layout.hosts, piece, cross);
}

Algo choose_allreduce(const HostLayout& layout, size_t bytes, const CostModel& m) {
  const Algo flat = choose_allreduce(layout.ranks, bytes, flat_params(layout, m));
  if (!layout.hierarchical()) return flat;
  const double t_flat = allreduce_cost_us(flat, layout, bytes, m);
  return allreduce_cost_us(Algo::kHier, layout, bytes, m) < t_flat ? Algo::kHier : flat;
}

Algo choose_allreduce(int n, size_t bytes, const CostParams& p) {
  Algo best = Algo::kRing;
  double best_t = allreduce_cost_us(Algo::kRing, n, bytes, p);
  for (Algo a : {Algo::kRhd, Algo::kTree}) {
    double t = allreduce_cost_us(a, n, bytes, p);
    if (t < best_t) best = a, best_t = t;
  }
  return best;
}

std::vector<Crossover> crossovers(int n, const CostParams& p) {
  std::vector<Crossover> out;
  for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) {
    Algo a = choose_allreduce(n, b, p);
    if (out.empty() || out.back().algo != a) out.push_back({b, a});
  }
  return out;
}

std::vector<Crossover> crossovers(const HostLayout& layout, const CostModel& m) {
  std::vector<Crossover> out;
  for (size_t b = 8; b <= (size_t{1} << 30); b *= 2) {
    Algo a = choose_allreduce(layout, b, m);
    if (out.empty() || out.back().algo != a) out.push_back({b, a});
  }
  return out;
}

namespace {
std::string describe(const std::vector<Crossover>& xs) {
  std::string s;
  for (const auto& c : xs) {
    if (!s.empty()) s += ", ";
    s += fmt::format("{} from {} B", to_string(c.algo), c.bytes);
  }
  return s;
}
}  // namespace

std::string describe_crossovers(int n, const CostParams& p) { return describe(crossovers(n, p)); }
std::string describe_crossovers(const HostLayout& layout, const CostModel& m) {
  return describe(crossovers(layout, m));
}

}  // namespace trn
