// A training loop written by hand from trn's building blocks, for when trn-train's loop is not
// the one you want: the GPT-2 model, the deterministic sampler, AdamW with clipping and a
// schedule, and safetensors output.
//
//   build/release/bin/example_custom_loop [steps] [out.safetensors]
#include <cmath>
#include <string>
#include <vector>

#include "collectives/core/log.h"
#include "collectives/core/main.h"
#include "runtime/data/data.h"
#include "runtime/io/safetensors.h"
#include "runtime/model/one_stage.h"
#include "runtime/optim/adamw.h"

int main(int argc, char** argv) {
  return trn::run_main("example_custom_loop", [&] {
    using namespace trn;
    const int64_t steps = argc > 1 ? std::stoll(argv[1]) : 50;
    const std::string out = argc > 2 ? argv[2] : "";
    const model::Config cfg = model::preset("tiny");
    const int B = 4, T = 64;  // sequences per step, tokens per sequence

    const data::Tokens tokens = data::Tokens::builtin();  // or data::Tokens::load(path, vocab)
    const data::Sampler sampler(tokens, T, /*seed=*/1);
    model::OneStageModel gpt(cfg, B, T, /*threads=*/1);
    gpt.init(/*seed=*/1);
    optim::AdamW adamw(gpt.layout(), {.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                                      .weight_decay = 0.1f});
    const optim::Schedule lr{optim::Schedule::Kind::kCosine, 1e-3f, 1e-4f, /*warmup=*/5, steps};

    std::vector<int32_t> inputs(B * T), targets(B * T);
    for (int64_t s = 0; s < steps; ++s) {
      sampler.fill(s, 0, B, inputs.data(), targets.data());
      gpt.zero_grad();
      // The gradient of the mean token loss: scale the summed losses by 1/(B*T).
      const double loss = gpt.forward_backward(inputs.data(), targets.data(), 1.0f / (B * T));
      const double norm =
          std::sqrt(optim::sum_of_squares(gpt.grads(), gpt.num_params(), gpt.pool()));
      optim::clip_to_norm(gpt.grads(), gpt.num_params(), norm, 1.0, gpt.pool());
      adamw.step(gpt.params(), gpt.grads(), lr.at(s), gpt.pool());
      if ((s + 1) % 10 == 0)
        log::info(log::Subsys::kTrain, "step {} loss {:.4f} grad norm {:.3f}", s + 1, loss, norm);
    }
    if (!out.empty()) io::save_gpt2(out, gpt.layout(), gpt.params());
    return 0;
  });
}
