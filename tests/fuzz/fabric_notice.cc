// Fuzz target: the peer watch's loss notices (collectives/fabric/messages.h), what a rank reads
// from its standing receive for each peer (peer_watch.h) in a world of 64 ranks. The input
// is the message; it is accepted (a notice naming a rank of the world, its detail on one line) or
// refused with one remote error. An accepted notice encoded again decodes the same.
//
// Round trip with the writer: encode_notice of a rank and a detail taken from the input (its
// first byte, the rest) must decode to that rank and to the detail cut to fit kNoticeBytes, with
// control characters as spaces.
#include "collectives/fabric/messages.h"
#include "tests/fuzz/fuzz.h"

namespace {

bool one_line(const std::string& s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return false;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trn;
  using namespace trn::fabric;
  constexpr int kWorld = 64;
  const std::string_view msg(reinterpret_cast<const char*>(data), size);

  Notice n;
  if (fuzz::accepts_wire([&] { n = decode_notice(msg, kWorld); })) {
    fuzz::require(n.lost >= 0 && n.lost < kWorld, "a notice of a rank outside the world accepted");
    fuzz::require(one_line(n.detail), "a notice's detail is not one line");
    fuzz::require(msg.size() <= kNoticeBytes, "a notice longer than a notice accepted");
    Notice back;
    if (!fuzz::accepts_wire([&] { back = decode_notice(encode_notice(n.lost, n.detail), kWorld); }))
      fuzz::fail("an encoded notice is refused");
    fuzz::require(back.lost == n.lost && back.detail == n.detail,
                  "a notice encoded again decodes differently");
  }

  if (size == 0) return 0;
  const int lost = data[0] % kWorld;
  const std::string_view detail = msg.substr(1);
  const std::string text = encode_notice(lost, detail);
  fuzz::require(text.size() <= kNoticeBytes, "an encoded notice is longer than a notice");
  Notice got;
  if (!fuzz::accepts_wire([&] { got = decode_notice(text, kWorld); }))
    fuzz::fail("an encoded notice is refused");
  std::string want(detail.substr(0, kNoticeBytes - fmt::format("L{} ", lost).size()));
  for (char& c : want)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  fuzz::require(got.lost == lost && got.detail == want, "an encoded notice decodes differently");
  return 0;
}
