// Transfers between real processes over real providers: tag matching with receives posted before
// and after the send, many outstanding operations, 0 B .. beyond the split size, byte by byte.
#include <algorithm>
#include <random>

#include "collectives/core/log.h"
#include "tests/integration/fabric/world.h"

using namespace trn;
using namespace trn::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kSizes[] = {0, 1, 7, 4096, 65537, (1u << 20) + 3};

Deadline soon() { return Deadline::after(30s); }

int run_child(const std::vector<std::string>& args, fabric::Options opts,
              const std::function<int(PointToPoint&, const WorldArgs&)>& body) {
  return run_main("fabric-test", [&] {
    WorldArgs w = parse_world(args);
    log::set_rank(w.rank);
    FileStore store(w.dir);
    opts.connect_timeout = 30s;
    auto p2p = fabric::connect(store, w.rank, w.size, opts);
    return body(*p2p, w);
  });
}

uint64_t seed_of(int src, int dst, uint64_t tag) { return static_cast<uint64_t>(src) * 1000003 + dst * 1009 + tag; }

int check(const char* what, int src, uint64_t tag, const std::vector<uint8_t>& buf, size_t len, size_t got, int dst) {
  if (got != len) {
    std::printf("%s: message from %d tag %lu: got %zu bytes, expected %zu\n", what, src, (unsigned long)tag, got, len);
    return 1;
  }
  int64_t bad = first_mismatch(seed_of(src, dst, tag), buf.data(), len);
  if (bad >= 0) {
    std::printf("%s: message from %d tag %lu (%zu bytes) differs at byte %ld\n", what, src, (unsigned long)tag, len, (long)bad);
    return 1;
  }
  return 0;
}

// Every rank sends every size to every other rank; receives for the first half of the tags are
// posted before the peer sends (it waits for a ready token), the second half after (the peer's
// data is already on its way when the receive is posted).
int exchange_all(PointToPoint& p, const WorldArgs& w) {
  const int n = w.size, me = w.rank;
  const uint64_t kReady = 1000, kSent = 1001;
  int failures = 0;
  for (int phase = 0; phase < 2; ++phase) {
    const bool before = phase == 0;
    std::vector<std::vector<uint8_t>> in, out;
    std::vector<RequestPtr> recvs, sends;
    std::vector<std::tuple<int, uint64_t, size_t>> expect;
    auto post_recvs = [&](int src) {
      for (size_t s = 0; s < std::size(kSizes); ++s) {
        uint64_t tag = phase * 100 + s;
        in.emplace_back(kSizes[s] + 16);
        recvs.push_back(p.irecv(src, tag, in.back().data(), kSizes[s] + 16));
        expect.emplace_back(src, tag, kSizes[s]);
      }
    };
    auto post_sends = [&](int dst) {
      for (size_t s = 0; s < std::size(kSizes); ++s) {
        uint64_t tag = phase * 100 + s;
        out.push_back(make_message(seed_of(me, dst, tag), kSizes[s]));
        sends.push_back(p.isend(dst, tag, out.back().data(), kSizes[s]));
      }
    };
    in.reserve(n * std::size(kSizes));
    out.reserve(n * std::size(kSizes));
    char token = 't', sink[16][1];
    std::vector<RequestPtr> tokens;
    if (before) {
      for (int q = 0; q < n; ++q) if (q != me) post_recvs(q);
      for (int q = 0; q < n; ++q) if (q != me) tokens.push_back(p.isend(q, kReady, &token, 1));
      for (int q = 0; q < n; ++q) if (q != me) p.irecv(q, kReady, sink[q], 1)->wait(soon());
      for (int q = 0; q < n; ++q) if (q != me) post_sends(q);
    } else {
      for (int q = 0; q < n; ++q) if (q != me) post_sends(q);
      for (int q = 0; q < n; ++q) if (q != me) tokens.push_back(p.isend(q, kSent, &token, 1));
      for (int q = 0; q < n; ++q) if (q != me) {
        p.irecv(q, kSent, sink[q], 1)->wait(soon());
        post_recvs(q);
      }
    }
    for (auto& r : recvs) r->wait(soon());
    for (auto& r : sends) r->wait(soon());
    for (auto& r : tokens) r->wait(soon());
    for (size_t i = 0; i < recvs.size(); ++i) {
      auto [src, tag, len] = expect[i];
      failures += check(before ? "posted before" : "posted after", src, tag, in[i], len, recvs[i]->bytes(), me);
    }
  }
  return failures ? 1 : 0;
}

// 400 messages each way between ranks 0 and 1, receives posted in reverse tag order and waited
// for in a shuffled order.
int many_outstanding(PointToPoint& p, const WorldArgs& w) {
  const int peer = 1 - w.rank, kCount = 400;
  auto size_of = [](int i) { return static_cast<size_t>((i * 7919) % 20000); };
  std::vector<std::vector<uint8_t>> in(kCount), out(kCount);
  std::vector<RequestPtr> recvs(kCount), sends(kCount);
  for (int i = kCount - 1; i >= 0; --i) {
    in[i].resize(size_of(i));
    recvs[i] = p.irecv(peer, 5000 + i, in[i].data(), in[i].size());
  }
  for (int i = 0; i < kCount; ++i) {
    out[i] = make_message(seed_of(w.rank, peer, 5000 + i), size_of(i));
    sends[i] = p.isend(peer, 5000 + i, out[i].data(), out[i].size());
  }
  std::vector<int> order(kCount);
  for (int i = 0; i < kCount; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(w.rank));
  int failures = 0;
  for (int i : order) {
    recvs[i]->wait(soon());
    failures += check("outstanding", peer, 5000 + i, in[i], size_of(i), recvs[i]->bytes(), w.rank);
  }
  for (auto& s : sends) s->wait(soon());
  return failures ? 1 : 0;
}

}  // namespace

TRN_TEST_CHILD(exchange_all) { return run_child(args, fabric::Options::from_environment(), exchange_all); }
TRN_TEST_CHILD(many_outstanding) { return run_child(args, fabric::Options::from_environment(), many_outstanding); }

TEST_CASE("fabric: every rank exchanges 0 B..1 MiB messages with every other, receives before and after sends",
          "[integration]") {
  for (const auto& env : provider_envs()) {
    for (int n : {2, 4}) {
      INFO(env_name(env) << " ranks " << n);
      require_all_ok(run_world("exchange_all", n, env));
    }
  }
}

TEST_CASE("fabric: hundreds of outstanding operations complete, matched by tag", "[integration]") {
  for (const auto& env : provider_envs()) {
    INFO(env_name(env));
    require_all_ok(run_world("many_outstanding", 2, env));
  }
}
