// All-reduce hello world: every rank contributes its rank number, every rank prints the sum.
//
//   trnrun --nproc-per-node 4 build/release/bin/example_allreduce_hello
//   mpirun -np 4 build/release/bin/example_allreduce_hello
#include <fmt/format.h>

#include <vector>

#include "collectives/core/main.h"
#include "runtime/dist/world.h"

int main() {
  return trn::run_main("allreduce_hello", [] {
    auto world = trn::dist::World::from_environment();  // trnrun, mpirun, srun or alone
    std::vector<float> x(1024, float(world->rank()));
    if (world->comm()) {
      auto work = world->comm()->all_reduce(x.data(), x.data(), x.size(), trn::DataType::kF32,
                                            trn::ReduceOp::kSum);
      work->wait();  // the all-reduce ran on the communicator's thread; overlap work here
    }
    const int n = world->size();
    fmt::print("rank {} of {}: sum of ranks = {} (expected {})\n", world->rank(), n, x[0], n * (n - 1) / 2);
    return x[0] == float(n * (n - 1) / 2) ? 0 : 1;
  });
}
