// The registry of model families (family.h): one line per family.
#include <fmt/format.h>

#include "collectives/core/error.h"
#include "runtime/model/family.h"
#include "runtime/model/gpt2.h"
#include "runtime/model/llama.h"
#include "runtime/model/mixtral.h"

namespace trn::model {

const std::vector<const Family*>& families() {
  static const std::vector<const Family*> all = {
      &gpt2_family(),
      &llama_family(),
      &mixtral_family(),
  };
  return all;
}

const Family& family(const std::string& arch) {
  std::vector<std::string> names;
  for (const Family* f : families()) {
    if (f->name == arch) return *f;
    names.push_back(f->name);
  }
  throw usage_error("unknown --arch '{}': use {}", arch, fmt::join(names, " or "));
}

}  // namespace trn::model
