// trn-train: trains GPT-2 (see trn-train --help).
#include <string>
#include <vector>

#include "collectives/core/main.h"
#include "runtime/train/options.h"
#include "runtime/train/trainer.h"

int main(int argc, char** argv) {
  return trn::run_main("trn-train", [&] {
    trn::train::Options opt;
    if (!trn::train::parse_options(std::vector<std::string>(argv + 1, argv + argc), &opt)) return 0;
    trn::train::Trainer trainer(opt);
    trainer.run();
    return 0;
  });
}
