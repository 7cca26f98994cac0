// trn-train: trains GPT-2 (see trn-train --help), alone or as a data-parallel worker under
// trnrun, mpirun or srun.
#include <string>
#include <vector>

#include "collectives/core/main.h"
#include "runtime/dist/train_main.h"
#include "runtime/train/options.h"

int main(int argc, char** argv) {
  return trn::run_main("trn-train", [&] {
    trn::train::Options opt;
    if (!trn::train::parse_options(std::vector<std::string>(argv + 1, argv + argc), &opt)) return 0;
    return trn::dist::train_main(opt);
  });
}
