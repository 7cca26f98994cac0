// Fuzz target: the datagrams a worker reads from its trnrun agent (launcher/client/agent_channel.h:
// decode_agent_answer, what AgentChannel::receive takes once the sender is the agent's socket).
// The input is the datagram. What decodes is an abort with a reason, or a resume a worker can go
// on in (a generation, and a rank and node rank inside its world size when it gives one); encoded
// again with the agent's encoders (encode_agent_abort, encode_agent_resume) it decodes the same.
//
// Round trip with the agent's encoder: a resume made from the input's first bytes is encoded and
// decoded; it comes back the same exactly when it is one a worker can go on in.
#include <google/protobuf/stubs/logging.h>

#include "launcher/client/agent_channel.h"
#include "tests/fuzz/fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  using namespace trn::control;
  static const bool quiet = (google::protobuf::SetLogHandler(nullptr), true);  // a string that is not UTF-8
  (void)quiet;
  const auto* bytes = reinterpret_cast<const char*>(data);

  if (const auto a = decode_agent_answer(bytes, size)) {
    if (a->abort) {
      fuzz::require(!a->reason.empty(), "an abort without a reason");
      const std::string again = encode_agent_abort(a->reason, 7);
      const auto back = decode_agent_answer(again.data(), again.size());
      fuzz::require(back && back->abort && back->reason == a->reason,
                    "an abort encoded again decodes differently");
    } else {
      const Resume& r = a->resume;
      fuzz::require(r.generation >= 0 && r.world_size >= 0, "a resume to a negative generation or world");
      fuzz::require(r.world_size == 0 || (r.rank >= 0 && r.rank < r.world_size && r.node_rank >= 0 &&
                                          r.node_rank < r.world_size),
                    "a resume to a place outside its world");
      const std::string again = encode_agent_resume(r);
      const auto back = decode_agent_answer(again.data(), again.size());
      fuzz::require(back && !back->abort && back->resume.generation == r.generation &&
                        back->resume.rank == r.rank && back->resume.world_size == r.world_size &&
                        back->resume.node_rank == r.node_rank,
                    "a resume encoded again decodes differently");
    }
  }

  Resume r;
  int32_t v[3] = {0, 0, 0};
  if (size) std::memcpy(&r.generation, data, std::min(size, sizeof(r.generation)));
  if (size > sizeof(r.generation)) std::memcpy(v, data + 8, std::min(size - 8, sizeof(v)));
  r.rank = v[0];
  r.world_size = v[1];
  r.node_rank = v[2];
  const std::string enc = encode_agent_resume(r);
  const auto back = decode_agent_answer(enc.data(), enc.size());
  const bool possible = r.generation >= 0 && r.world_size >= 0 &&
                        (r.world_size == 0 || (r.rank >= 0 && r.rank < r.world_size && r.node_rank >= 0 &&
                                               r.node_rank < r.world_size));
  fuzz::require(back.has_value() == possible,
                possible ? "a possible resume is refused" : "an impossible resume decodes");
  if (back)
    fuzz::require(!back->abort && back->resume.generation == r.generation && back->resume.rank == r.rank &&
                      back->resume.world_size == r.world_size && back->resume.node_rank == r.node_rank,
                  "a resume does not come back as it was encoded");
  return 0;
}
