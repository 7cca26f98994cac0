#include "runtime/plan/moe_loads.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "collectives/core/error.h"
#include "runtime/io/input_file.h"

namespace trn::plan {

namespace {

// The busiest of ep ranks' summed loads over their mean, for one layer's loads.
double busiest_rank(const std::vector<double>& load, int ep) {
  const size_t E = load.size(), per = E / size_t(ep);
  double total = 0, most = 0;
  for (size_t r = 0; r < size_t(ep); ++r) {
    double rows = 0;
    for (size_t e = r * per; e < (r + 1) * per; ++e) rows += load[e];
    total += rows;
    most = std::max(most, rows);
  }
  return total > 0 ? most / (total / ep) : 1.0;
}

}  // namespace

std::array<double, 3> MoeLoads::compute(int ep) const {
  if (ep <= 1 || steps.empty()) return {1.0, 1.0, 1.0};
  const size_t L = steps[0].size();
  double time = 0, peak = 0, anywhere = 1;
  for (size_t l = 0; l < L; ++l) {
    double most = 0, over = 0;
    for (const auto& s : steps) {
      const double b = busiest_rank(s[l], ep);
      most = std::max(most, b);
      over += b;
    }
    time += over / double(steps.size());
    peak += most;
    anywhere = std::max(anywhere, most);
  }
  if (L == 0) return {1.0, 1.0, 1.0};
  return {time / double(L), peak / double(L), anywhere};
}

std::array<double, 3> MoeLoads::answers(int ep) const {
  const auto it = known_.find(ep);
  return it != known_.end() ? it->second : compute(ep);
}

double MoeLoads::busiest(int ep, bool peak) const { return answers(ep)[peak ? 1 : 0]; }

double MoeLoads::busiest_anywhere(int ep) const { return answers(ep)[2]; }

MoeLoads MoeLoads::read(const std::string& path, int n_layer, int n_experts) {
  MoeLoads m;
  m.source = path;
  std::istringstream in(io::read_input_file("--moe-loads", path));
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      // A line cut short by a kill is the file's last: the lines before it count.
      if (in.peek() == std::char_traits<char>::eof()) break;
      throw usage_error("--moe-loads {}: line {} is not JSON", path, line_no);
    }
    if (!j.is_object() || !j.contains("moe_loads")) continue;  // a validation line, or no loads
    const nlohmann::json& loads = j["moe_loads"];
    std::vector<std::vector<double>> step;
    if (loads.is_array())
      for (const nlohmann::json& layer : loads) {
        std::vector<double> row;
        if (layer.is_array())
          for (const nlohmann::json& x : layer)
            if (x.is_number()) row.push_back(x.get<double>());
        step.push_back(std::move(row));
      }
    bool shaped = step.size() == size_t(n_layer);
    for (const auto& row : step) shaped = shaped && row.size() == size_t(n_experts);
    if (!shaped)
      throw usage_error(
          "--moe-loads {}: line {}'s moe_loads are not {} layers of {} experts (another model's run?)", path,
          line_no, n_layer, n_experts);
    m.steps.push_back(std::move(step));
  }
  for (int ep = 2; !m.steps.empty() && ep <= n_experts; ++ep)
    if (n_experts % ep == 0) m.known_[ep] = m.compute(ep);
  if (m.steps.empty())
    throw usage_error(
        "--moe-loads {}: no line has moe_loads (write them with trn-train --metrics-jsonl FILE "
        "--metrics-moe-loads)",
        path);
  return m;
}

}  // namespace trn::plan
