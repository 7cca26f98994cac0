// The built-in corpus: English-like sentences from a small grammar plus arithmetic facts, drawn
// from a fixed seed. Spelling, word order and the sums are all learnable, so the loss of even the
// tiny model falls well below ln(256) within a few hundred steps.
#include <array>
#include <string>

#include "runtime/data/data.h"
#include "runtime/util/random.h"

namespace trn::data {
namespace {

template <size_t N>
const char* pick(Rng& r, const std::array<const char*, N>& words) {
  return words[r.below(N)];
}

const std::array<const char*, 16> kAdjectives = {
    "small", "bright", "quiet", "heavy", "old", "young", "green", "cold",
    "happy", "tired", "clever", "brave", "gentle", "busy", "wooden", "silver"};
const std::array<const char*, 20> kNouns = {
    "cat", "river", "teacher", "engine", "garden", "robot", "farmer", "bird", "ship", "city",
    "child", "window", "mountain", "baker", "train", "lamp", "dog", "forest", "king", "sailor"};
const std::array<const char*, 16> kVerbs = {
    "sees", "follows", "builds", "carries", "finds", "paints", "watches", "helps",
    "lifts", "visits", "cleans", "chases", "repairs", "greets", "draws", "counts"};
const std::array<const char*, 8> kPlaces = {"near the sea", "in the morning", "under the bridge",
                                            "at night",     "by the road",    "in the rain",
                                            "on the hill",  "after dinner"};

void sentence(Rng& r, std::string& out) {
  switch (r.below(4)) {
    case 0:
      out += "the ";
      out += pick(r, kAdjectives);
      out += " ";
      out += pick(r, kNouns);
      out += " ";
      out += pick(r, kVerbs);
      out += " the ";
      out += pick(r, kNouns);
      out += ".";
      break;
    case 1:
      out += "a ";
      out += pick(r, kNouns);
      out += " ";
      out += pick(r, kVerbs);
      out += " a ";
      out += pick(r, kAdjectives);
      out += " ";
      out += pick(r, kNouns);
      out += " ";
      out += pick(r, kPlaces);
      out += ".";
      break;
    case 2: {
      const uint64_t a = r.below(50), b = r.below(50);
      out += std::to_string(a) + " plus " + std::to_string(b) + " is " + std::to_string(a + b) + ".";
      break;
    }
    default: {
      const char* noun = pick(r, kNouns);
      out += "every ";
      out += noun;
      out += " that ";
      out += pick(r, kVerbs);
      out += " is ";
      out += pick(r, kAdjectives);
      out += ", so the ";
      out += noun;
      out += " ";
      out += pick(r, kVerbs);
      out += " it again.";
      break;
    }
  }
}

}  // namespace

std::string builtin_corpus_text(size_t bytes) {
  Rng r(20240520);
  std::string out;
  out.reserve(bytes + 256);
  while (out.size() < bytes) {
    const uint64_t n = 2 + r.below(4);
    for (uint64_t i = 0; i < n; ++i) {
      if (i) out += " ";
      sentence(r, out);
    }
    out += "\n";
  }
  out.resize(bytes);
  return out;
}

}  // namespace trn::data
