// Fuzz target: a dataset directory's manifest (runtime/data/dataset_dir.h, trn-dataset.json),
// what every reader of trn-data's shards checks first. The input is the manifest; the directory
// beside it holds one fixed shard (train-00000.bin and .idx). The directory is checked and read
// as --data reads it: accepted only when the manifest names exactly those two files with their
// sizes and hashes, else refused in one line.
#include "runtime/data/data.h"
#include "runtime/data/dataset_dir.h"
#include "runtime/data/indexed.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  namespace fs = std::filesystem;
  const fs::path dir = fuzz::scratch() / "dataset";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir);
  {
    data::IndexedWriter w((dir / "train-00000").string(), 100);
    const int32_t tokens[3] = {1, 2, 3};
    w.add_document(tokens, 3);
    w.finish();
  }
  fuzz::put(dir / data::kDatasetManifest, std::string_view(reinterpret_cast<const char*>(data), size));
  bool checked = false;
  fuzz::accepts([&] { checked = data::check_dataset_dir(dir.string(), "--data").has_value(); });
  const bool loaded = fuzz::accepts([&] {
    const data::Tokens t = data::Tokens::load(dir.string(), 100);
    fuzz::require(t.size() == 3 && t[0] == 1 && t[2] == 3, "the fixed shard read back wrong");
  });
  fuzz::require(!loaded || checked, "a directory whose manifest was refused was read");
  return 0;
}
