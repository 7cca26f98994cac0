// Fuzz target: sharded checkpoints (runtime/checkpoint/checkpoint.h), what --resume and trn-ckpt
// read. An input is a step directory: its parts (fuzz.h) are manifest.json, then rank-00000.shard,
// rank-00001.shard, ... Before reading, the manifest's file sizes and XXH64s are set to the
// shards' real ones when the manifest is JSON that lists them, so that mutations of a shard reach
// its header parser instead of stopping at the manifest's checksum.
//
// verify(), list(), model_of() and load() run on it. A checkpoint that loads (and whose model is
// small) is saved again by this process, alone, and loaded from there: the parameters and both
// AdamW moments must come back bit for bit.
#include <xxhash.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "runtime/checkpoint/checkpoint.h"
#include "tests/fuzz/fuzz.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string fixed_manifest(std::string_view manifest, const std::vector<std::string_view>& shards) {
  json j = json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("files") || !j["files"].is_array()) return std::string(manifest);
  for (auto& f : j["files"]) {
    if (!f.is_object() || !f.contains("name") || !f["name"].is_string()) continue;
    const std::string name = f["name"].get<std::string>();
    for (size_t k = 0; k < shards.size(); ++k)
      if (name == fmt::format("rank-{:05}.shard", k)) {
        f["bytes"] = shards[k].size();
        f["xxh64"] = XXH64(shards[k].data(), shards[k].size(), 0);
      }
  }
  return j.dump(1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  const auto parts = fuzz::split(data, size, 9);
  const fs::path root = fuzz::scratch() / "ckpt";
  const fs::path dir = root / "step-00000001";
  std::error_code ec;
  fs::remove_all(root, ec);
  fs::create_directories(dir);
  const std::vector<std::string_view> shards(parts.begin() + 1, parts.end());
  fuzz::put(dir / "manifest.json", fixed_manifest(parts[0], shards));
  for (size_t k = 0; k < shards.size(); ++k) fuzz::put(dir / fmt::format("rank-{:05}.shard", k), shards[k]);

  fuzz::accepts([&] { checkpoint::list(root.string()); });
  fuzz::accepts([&] { checkpoint::latest(root.string()); });
  if (!fuzz::accepts([&] { checkpoint::verify(dir.string()); })) return 0;
  model::Config c;
  if (!fuzz::accepts([&] { c = checkpoint::model_of(dir.string()); })) return 0;
  // Parameters, first and second moments: small models only, so an input cannot ask for memory.
  std::optional<model::ParamLayout> layout;
  if (!fuzz::accepts([&] { layout.emplace(c); }) || layout->total() > (size_t{1} << 20)) return 0;
  const size_t n = layout->total();
  std::vector<float> p(n), m(n), v(n);
  checkpoint::State st;
  if (!fuzz::accepts([&] { st = checkpoint::load(dir.string(), *layout, p.data(), m.data(), v.data()); })) return 0;

  const fs::path again = fuzz::scratch() / "again";
  fs::remove_all(again, ec);
  fs::create_directories(again);
  const std::string saved = checkpoint::save(again.string(), st, parallel::Plan{}, *layout, p.data(), m.data(),
                                             v.data(), parallel::Coords{}, nullptr, 1);
  std::vector<float> p2(n, -1.0f), m2(n, -1.0f), v2(n, -1.0f);
  const checkpoint::State st2 = checkpoint::load(saved, *layout, p2.data(), m2.data(), v2.data());
  fuzz::require(std::memcmp(p.data(), p2.data(), n * 4) == 0 && std::memcmp(m.data(), m2.data(), n * 4) == 0 &&
                    std::memcmp(v.data(), v2.data(), n * 4) == 0,
                "a checkpoint saved again loads different values");
  fuzz::require(st2.step == st.step && st2.optimizer_step == st.optimizer_step && st2.seed == st.seed &&
                    st2.run_id == st.run_id && st2.settings == st.settings,
                "a checkpoint saved again has a different state");
  return 0;
}
