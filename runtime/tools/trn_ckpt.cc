// trn-ckpt: look after trn-train's sharded checkpoints.
//
//   trn-ckpt ls DIR [--json]                      steps, committed or not, layout, size
//   trn-ckpt verify DIR|DIR/step-N [--json]       the validation a load runs; exit 1 when damaged
//   trn-ckpt consolidate DIR|DIR/step-N --out FILE [--json]
//                                                 one Hugging Face GPT-2 safetensors file
//
// DIR alone means its newest committed checkpoint (verify: every one).
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "collectives/core/error.h"
#include "collectives/core/flags.h"
#include "collectives/core/main.h"
#include "runtime/checkpoint/checkpoint.h"
#include "runtime/io/safetensors.h"

namespace {

using namespace trn;

struct Args {
  bool json = false;
  std::string out;
  std::vector<std::string> positional;  // the command and its checkpoint
};

flags::Table table(Args* a) {
  return {
      .program = "trn-ckpt",
      .summary = "\nLooks after trn-train's sharded checkpoints. DIR alone means its newest committed checkpoint\n"
                 "(verify: every one).\n"
                 "  ls           steps, committed or not, layout, size\n"
                 "  verify       the validation a load runs; exit 1 when damaged\n"
                 "  consolidate  one Hugging Face GPT-2 safetensors file\n",
      .flags =
          {
              {"--json", &a->json, "machine-readable output"},
              {"--out", &a->out, "consolidate: the file to write", "", "FILE.safetensors"},
          },
      .positional = flags::Positional::kInterleaved,
      .rest = &a->positional,
      .usage = "ls DIR [--json]\n"
               "       trn-ckpt verify DIR|DIR/step-N [--json]\n"
               "       trn-ckpt consolidate DIR|DIR/step-N --out FILE [--json]",
  };
}

bool is_step_dir(const std::string& p) {
  const auto slash = p.find_last_of('/');
  const std::string base = slash == std::string::npos ? p : p.substr(slash + 1);
  return base.rfind("step-", 0) == 0;
}

std::string newest(const std::string& dir) {
  std::string found;
  for (const auto& e : checkpoint::list(dir))
    if (e.committed) found = e.path;
  if (found.empty()) throw usage_error("{} holds no committed checkpoint", dir);
  return found;
}

int run(const std::vector<std::string>& args) {
  Args a;
  if (args.empty()) {
    std::fputs(flags::help(table(&a)).c_str(), stderr);
    return 2;
  }
  if (!flags::parse(table(&a), args)) return 0;
  if (a.positional.empty()) throw usage_error("no command given: use ls, verify or consolidate; run trn-ckpt --help");
  if (a.positional.size() > 2) throw usage_error("unexpected argument '{}'", a.positional[2]);
  const std::string cmd = a.positional[0];
  std::string target = a.positional.size() > 1 ? a.positional[1] : "";
  const std::string& out = a.out;
  const bool as_json = a.json;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  if (target.empty()) throw usage_error("{} needs a checkpoint directory; run trn-ckpt --help", cmd);
  if (cmd == "ls") {
    const auto entries = checkpoint::list(target);
    nlohmann::json j = nlohmann::json::array();
    for (const auto& e : entries) {
      if (as_json)
        j.push_back({{"path", e.path}, {"step", e.step}, {"committed", e.committed}, {"model", e.model},
                     {"layout", e.layout}, {"bytes", e.bytes}});
      else
        fmt::print("{:>9}  {:<11}  {:>10.1f} MB  {}  {}\n", e.step, e.committed ? "committed" : "uncommitted",
                   e.bytes / 1e6, e.layout, e.model);
    }
    if (as_json) fmt::print("{}\n", j.dump());
    return 0;
  }
  if (cmd == "verify") {
    std::vector<std::string> paths;
    if (is_step_dir(target)) paths.push_back(target);
    else
      for (const auto& e : checkpoint::list(target))
        if (e.committed) paths.push_back(e.path);
    if (paths.empty()) throw usage_error("{} holds no committed checkpoint", target);
    int bad = 0;
    nlohmann::json j = nlohmann::json::array();
    for (const auto& p : paths) {
      std::string problem;
      try {
        checkpoint::verify(p);
      } catch (const Error& e) {
        problem = e.what();
        ++bad;
      }
      if (as_json) j.push_back({{"path", p}, {"ok", problem.empty()}, {"problem", problem}});
      else fmt::print("{}: {}\n", p, problem.empty() ? "ok" : problem);
    }
    if (as_json) fmt::print("{}\n", j.dump());
    return bad ? 1 : 0;
  }
  if (cmd == "consolidate") {
    if (out.empty()) throw usage_error("consolidate needs --out FILE.safetensors");
    const std::string path = is_step_dir(target) ? target : newest(target);
    checkpoint::verify(path);
    const model::Config c = checkpoint::model_of(path);
    const model::ParamLayout full(c);
    std::vector<float> params(full.total()), m(full.total()), v(full.total());
    const checkpoint::State st = checkpoint::load(path, full, params.data(), m.data(), v.data());
    io::save_gpt2(out, full, params.data(), {{"trn.model", c.describe()}, {"trn.steps", std::to_string(st.step)}});
    if (as_json) fmt::print("{}\n", nlohmann::json{{"checkpoint", path}, {"step", st.step}, {"out", out}}.dump());
    else fmt::print("wrote {} (step {} of {}, {})\n", out, st.step, path, c.describe());
    return 0;
  }
  throw usage_error("unknown command '{}': use ls, verify or consolidate", cmd);
}

}  // namespace

int main(int argc, char** argv) {
  return trn::run_main("trn-ckpt", [&] { return run(std::vector<std::string>(argv + 1, argv + argc)); });
}
