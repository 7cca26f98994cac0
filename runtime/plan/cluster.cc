#include "runtime/plan/cluster.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "collectives/core/error.h"
#include "runtime/io/atomic_file.h"
#include "runtime/io/input_file.h"

namespace trn::plan {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The value at path (keys joined by '.') as a number: a usage error naming the file and the field
// when it is absent, not a number, or not positive (allow_zero: not negative).
double number(const json& root, const std::string& file, const std::string& path, bool allow_zero = false) {
  const json* j = &root;
  std::string at;
  std::istringstream keys(path);
  for (std::string k; std::getline(keys, k, '.');) {
    at += (at.empty() ? "" : ".") + k;
    if (!j->is_object() || !j->contains(k))
      throw usage_error("cluster file {}: field \"{}\" is missing", file, at);
    j = &(*j)[k];
  }
  if (!j->is_number()) throw usage_error("cluster file {}: field \"{}\" must be a number", file, path);
  const double v = j->get<double>();
  if (!std::isfinite(v) || v < 0 || (!allow_zero && v == 0))
    throw usage_error("cluster file {}: field \"{}\" must be {}, got {}", file, path,
                      allow_zero ? "0 or more" : "more than 0", v);
  return v;
}

double optional_number(const json& j, const std::string& file, const char* key, double fallback) {
  return j.is_object() && j.contains(key) ? number(j, file, key, true) : fallback;
}

PieceTimes pieces_from(const json& j, const std::string& file) {
  PieceTimes t;
  const auto get = [&](const char* k) { return number(j, file, k, true); };
  t.embedding_fwd = get("embedding_fwd");
  t.embedding_bwd = get("embedding_bwd");
  t.block_fwd = get("block_fwd");
  t.block_bwd = get("block_bwd");
  t.block_bwd_input = get("block_bwd_input");
  t.block_bwd_weight = get("block_bwd_weight");
  t.head_fwd = get("head_fwd");
  t.head_bwd = get("head_bwd");
  return t;
}

json pieces_json(const PieceTimes& t) {
  return {{"embedding_fwd", t.embedding_fwd},
          {"embedding_bwd", t.embedding_bwd},
          {"block_fwd", t.block_fwd},
          {"block_bwd", t.block_bwd},
          {"block_bwd_input", t.block_bwd_input},
          {"block_bwd_weight", t.block_bwd_weight},
          {"head_fwd", t.head_fwd},
          {"head_bwd", t.head_bwd}};
}

// A link's cost parameters from a file's "alpha_us", "beta_us_per_kib", ... (a local file) or
// from its published bandwidth and latency (a device cluster's).
CostParams link_from(const json& j, const std::string& file, const std::string& where,
                     const CostParams& base) {
  CostParams p = base;
  if (!j.is_object()) throw usage_error("cluster file {}: field \"{}\" must be an object", file, where);
  p.alpha_us = optional_number(j, file, "alpha_us", p.alpha_us);
  p.beta_us_per_kib = optional_number(j, file, "beta_us_per_kib", p.beta_us_per_kib);
  p.gamma_us_per_kib = optional_number(j, file, "gamma_us_per_kib", p.gamma_us_per_kib);
  p.ring_overlap = optional_number(j, file, "ring_overlap", p.ring_overlap);
  return p;
}

Cluster load_local(const std::string& file) {
  // Checked as a regular file before a byte is read: a FIFO there would block the planner.
  if (::access(file.c_str(), F_OK) != 0)
    throw usage_error("--cluster local:{}: cannot read it; write one with trn-plan calibrate --out {}", file,
                      file);
  const std::string text = io::read_input_file("cluster file", file);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error("cluster file {} is not JSON: {}", file, e.what());
  }
  if (!j.is_object() || j.value("format", "") != "trn-local-cluster")
    throw usage_error(
        "{} is not a local cluster file (its \"format\" must be \"trn-local-cluster\"); write one with "
        "trn-plan calibrate --out FILE",
        file);
  Cluster c;
  c.name = "local";
  c.source = file;
  c.local = true;
  c.nodes = j.contains("hosts") ? int(number(j, file, "hosts")) : 1;
  c.cpu_cores = int(number(j, file, "cpu_cores"));
  if (j.contains("hosts_share_cores")) {
    if (!j["hosts_share_cores"].is_boolean())
      throw usage_error("cluster file {}: field \"hosts_share_cores\" must be true or false", file);
    c.hosts_share_cores = j["hosts_share_cores"].get<bool>();
  }
  c.host_memory_bytes = number(j, file, "host_memory_gib") * kGiB;
  c.links.intra =
      link_from(j.value("intra_node", json::object()), file, "intra_node", params_for_transport("shm"));
  c.links.inter =
      link_from(j.value("inter_node", json::object()), file, "inter_node", params_for_transport("tcp"));
  c.delay_s = optional_number(j.value("inter_node", json::object()), file, "delay_us", 0) * 1e-6;
  c.storage_bytes_per_s = optional_number(j, file, "storage_bytes_per_s", c.storage_bytes_per_s);
  if (!j.contains("calibration") || !j["calibration"].is_object())
    throw usage_error("cluster file {}: field \"calibration\" is missing", file);
  const json& k = j["calibration"];
  Calibration& cal = c.calibration;
  cal.model = k.value("model", "");
  cal.precision = k.value("precision", "fp32");
  cal.cpu = k.value("cpu", "");
  cal.seq_len = int(number(k, file, "seq_len"));
  cal.adamw_s_per_param = number(k, file, "adamw_s_per_param");
  cal.norm_s_per_param = number(k, file, "norm_s_per_param");
  cal.copy_bytes_per_s = number(k, file, "copy_bytes_per_s");
  cal.base_rss_bytes = number(k, file, "base_rss_mib", true) * 1024.0 * 1024.0;
  cal.base_rss_network_bytes =
      optional_number(k, file, "base_rss_network_mib", cal.base_rss_bytes / 1048576.0) * 1048576.0;
  cal.base_rss_single_bytes =
      optional_number(k, file, "base_rss_single_mib", cal.base_rss_bytes / 1048576.0) * 1048576.0;
  cal.step_scale = optional_number(k, file, "step_scale", 1.0);
  cal.busy_scale = optional_number(k, file, "busy_scale", 1.0);
  cal.oversubscribed_alpha_us = optional_number(k, file, "oversubscribed_alpha_us", 0.0);
  cal.oversubscribed_behind_alpha_us =
      optional_number(k, file, "oversubscribed_behind_alpha_us", cal.oversubscribed_alpha_us);
  cal.zero3_scale = optional_number(k, file, "zero3_scale", 1.0);
  cal.ranks_scale = optional_number(k, file, "ranks_scale", 1.0);
  if (!(cal.step_scale > 0) || !(cal.busy_scale > 0) || !(cal.zero3_scale > 0) || !(cal.ranks_scale > 0))
    throw usage_error(
        "cluster file {}: calibration.step_scale, busy_scale, zero3_scale and ranks_scale must be positive",
        file);
  if (!k.contains("pieces") || !k["pieces"].is_array() || k["pieces"].empty())
    throw usage_error("cluster file {}: field \"calibration.pieces\" must be a non-empty list", file);
  for (const json& e : k["pieces"]) {
    const int tp = int(number(e, file, "tp")), batch = int(number(e, file, "batch"));
    cal.pieces[tp][batch] = pieces_from(e, file);
  }
  return c;
}

Cluster load_device_cluster(const std::string& name, int nodes, const std::string& file) {
  const std::string text = io::read_input_file("cluster file", file);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error("cluster file {} is not JSON: {}", file, e.what());
  }
  Cluster c;
  c.name = name;
  c.source = file;
  c.nodes = nodes;
  c.ranks_per_node = int(number(j, file, "ranks_per_node"));
  c.cpu_cores = int(number(j, file, "node.cpu_cores"));
  c.host_memory_bytes = number(j, file, "node.host_memory_gib") * kGiB;
  c.device_memory_bytes = number(j, file, "node.device_memory_gib") * kGiB;
  c.matmul_flops_fp32 = number(j, file, "device.matmul_tflops.fp32") * 1e12;
  c.matmul_flops_bf16 = number(j, file, "device.matmul_tflops.bf16") * 1e12;
  c.matmul_efficiency = number(j, file, "device.matmul_efficiency");
  c.memory_bytes_per_s = number(j, file, "device.memory_gbps") * 1e9;
  c.launch_overhead_s = number(j, file, "device.launch_overhead_us", true) * 1e-6;
  for (const char* part : {"node", "device", "intra_node", "inter_node"})
    if (!j.contains(part) || !j[part].is_object())
      throw usage_error("cluster file {}: field \"{}\" must be an object", file, part);
  if (j["device"].contains("fp8_format")) {
    const json& f = j["device"]["fp8_format"];
    if (!f.is_string() || (f != "ocp" && f != "neuron"))
      throw usage_error("cluster file {}: field \"device.fp8_format\" must be \"ocp\" or \"neuron\", got {}",
                        file, f.dump());
    c.fp8_format = parse_fp8_format(f.get<std::string>());
  }
  const double link_bytes = number(j, file, "intra_node.link_gbps") * 1e9 / 8;
  const double links = number(j, file, "intra_node.links_per_device");
  c.hop_latency_s = number(j, file, "intra_node.latency_us") * 1e-6;
  c.rails = int(number(j, file, "inter_node.rails"));
  c.node_bytes_per_s = c.rails * number(j, file, "inter_node.rail_gbps") * 1e9 / 8;
  const double inter_latency_us = number(j, file, "inter_node.latency_us");
  // A ring inside the node moves each rank's data over its links in both directions at once (a
  // bidirectional ring): half its links carry one ring's traffic each way.
  CostParams intra = params_for_transport("efa");
  intra.alpha_us = c.hop_latency_s * 1e6 + c.launch_overhead_s * 1e6;
  intra.beta_us_per_kib = 1024.0 / (link_bytes * std::max(1.0, links / 2)) * 1e6;
  intra.gamma_us_per_kib = 1024.0 / c.memory_bytes_per_s * 3 * 1e6;  // read two, write one
  intra.ring_overlap = 0.9;
  intra.link_shared = 0;
  // Between nodes: EFA; one stream may use the node's rails (trn stripes a message over them);
  // the ranks of a node sending across at once share them (link_shared 1).
  CostParams inter = params_for_transport("efa");
  inter.alpha_us = inter_latency_us;
  inter.beta_us_per_kib = 1024.0 / c.node_bytes_per_s * 1e6;
  inter.gamma_us_per_kib = intra.gamma_us_per_kib;
  inter.link_shared = 1;
  c.links = CostModel{intra, inter};
  // Checkpoint storage of a node in GB/s (bytes), shared by its ranks; 1 GB/s unless given.
  c.storage_bytes_per_s = optional_number(j, file, "storage_gbytes_per_s", 1.0) * 1e9 / c.ranks_per_node;
  return c;
}

}  // namespace

PieceTimes Calibration::at(int tp, int batch) const {
  const auto it = pieces.find(tp);
  if (it == pieces.end() || it->second.empty()) return {};
  const auto& by_batch = it->second;
  if (auto e = by_batch.find(batch); e != by_batch.end()) return e->second.scaled(step_scale);
  // Linear in the batch between the two nearest measured sizes (or beyond the outermost two).
  auto hi = by_batch.lower_bound(batch);
  if (hi == by_batch.end()) --hi;
  auto lo = hi;
  if (lo == by_batch.begin()) {
    if (std::next(hi) == by_batch.end()) {  // one size measured: proportional
      return hi->second.scaled(double(batch) / hi->first * step_scale);
    }
    ++hi;
  } else {
    --lo;
  }
  const double f = double(batch - lo->first) / double(hi->first - lo->first);
  PieceTimes t;
  const PieceTimes &a = lo->second, &b = hi->second;
  auto mix = [&](double PieceTimes::*m) { t.*m = std::max(0.0, a.*m + f * (b.*m - a.*m)); };
  for (auto m : {&PieceTimes::embedding_fwd, &PieceTimes::embedding_bwd, &PieceTimes::block_fwd,
                 &PieceTimes::block_bwd, &PieceTimes::block_bwd_input, &PieceTimes::block_bwd_weight,
                 &PieceTimes::head_fwd, &PieceTimes::head_bwd})
    mix(m);
  return t.scaled(step_scale);
}

double Cluster::rank_memory(int world) const {
  if (device_memory_bytes > 0) return device_memory_bytes;
  // A test bed's hosts are one machine: its memory is all of theirs.
  return host_memory_bytes / std::max(1, hosts_share_cores ? world : per_node(world));
}

std::string clusters_dir(const std::string& program_path) {
  if (const char* env = std::getenv("TRN_CLUSTERS"); env && *env) return env;
  std::error_code ec;
  const fs::path exe =
      fs::canonical(program_path.find('/') == std::string::npos ? "/proc/self/exe" : program_path, ec);
  if (!ec) {
    const fs::path installed = exe.parent_path().parent_path() / "share" / "trn" / "clusters";
    if (fs::is_directory(installed, ec)) return installed.string();
  }
#ifdef TRN_SOURCE_DIR
  return std::string(TRN_SOURCE_DIR) + "/deploy/clusters";
#else
  return "deploy/clusters";
#endif
}

std::vector<std::string> cluster_names(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".json") out.push_back(e.path().stem().string());
  std::sort(out.begin(), out.end());
  return out;
}

Cluster load_cluster(const std::string& spec, const std::string& dir) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == spec.size()) {
    std::string names;
    for (const auto& n : cluster_names(dir)) names += n + ":N|";
    throw usage_error("--cluster {}: expected {}local:FILE", spec, names);
  }
  const std::string kind = spec.substr(0, colon), rest = spec.substr(colon + 1);
  if (kind == "local") return load_local(rest);
  const std::string file = dir + "/" + kind + ".json";
  if (!fs::exists(file)) {
    std::string names;
    for (const auto& n : cluster_names(dir)) names += (names.empty() ? "" : ", ") + n;
    throw usage_error("--cluster {}: no cluster file {} (known: {}; or local:FILE)", spec, file,
                      names.empty() ? "none" : names);
  }
  int nodes = 0;
  try {
    size_t used = 0;
    nodes = std::stoi(rest, &used);
    if (used != rest.size()) nodes = 0;
  } catch (const std::exception&) {
    nodes = 0;
  }
  if (nodes <= 0)
    throw usage_error("--cluster {}: the node count must be a positive integer, got '{}'", spec, rest);
  return load_device_cluster(kind, nodes, file);
}

void save_local_cluster(const std::string& path, const Calibration& cal, int cpu_cores, double memory_bytes) {
  json pieces = json::array();
  for (const auto& [tp, by_batch] : cal.pieces)
    for (const auto& [batch, t] : by_batch) {
      json e = pieces_json(t);
      e["tp"] = tp;
      e["batch"] = batch;
      pieces.push_back(e);
    }
  const auto link = [](const CostParams& p) {
    return json{{"alpha_us", p.alpha_us},
                {"beta_us_per_kib", p.beta_us_per_kib},
                {"gamma_us_per_kib", p.gamma_us_per_kib},
                {"ring_overlap", p.ring_overlap}};
  };
  json inter = link(cal.inter);
  inter["delay_us"] = 0;
  const json j = {
      {"format", "trn-local-cluster"},
      {"hosts", 1},
      {"hosts_share_cores", false},
      {"cpu_cores", cpu_cores},
      {"host_memory_gib", memory_bytes / kGiB},
      {"intra_node", link(cal.intra)},
      {"links", cal.links_measured ? "measured by trn-plan probe-link, 2 ranks of this host"
                                   : "the transports' stated figures"},
      {"inter_node", inter},
      {"calibration",
       {{"model", cal.model},
        {"precision", cal.precision},
        {"seq_len", cal.seq_len},
        {"cpu", cal.cpu},
        {"adamw_s_per_param", cal.adamw_s_per_param},
        {"norm_s_per_param", cal.norm_s_per_param},
        {"copy_bytes_per_s", cal.copy_bytes_per_s},
        {"base_rss_mib", cal.base_rss_bytes / (1024.0 * 1024.0)},
        {"base_rss_network_mib", cal.base_rss_network_bytes / (1024.0 * 1024.0)},
        {"base_rss_single_mib", cal.base_rss_single_bytes / (1024.0 * 1024.0)},
        {"step_scale", cal.step_scale},
        {"busy_scale", cal.busy_scale},
        {"oversubscribed_alpha_us", cal.oversubscribed_alpha_us},
        {"oversubscribed_behind_alpha_us", cal.oversubscribed_behind_alpha_us},
        {"zero3_scale", cal.zero3_scale},
        {"ranks_scale", cal.ranks_scale},
        {"pieces", pieces}}},
  };
  io::write_file_atomic(path, j.dump(2) + "\n");
}

}  // namespace trn::plan
