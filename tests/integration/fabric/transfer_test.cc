// Transfers between real processes over real providers: tag matching with receives posted before
// and after the send, many outstanding operations, 0 B .. beyond the split size, byte by byte.
#include <algorithm>
#include <random>

#include "collectives/core/log.h"
#include "collectives/fabric/transport.h"
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
    const int rc = body(*p2p, w);
    // No rank closes its endpoint while a peer is still in its body: a sender's last completion
    // can need the receiver's transport after the receiver has all its data.
    store.set("done/" + std::to_string(w.rank), "1");
    for (int r = 0; r < w.size; ++r) store.get("done/" + std::to_string(r), soon());
    return rc;
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

// Messages split into pieces of max_piece bytes (extra[0]) both ways between ranks 0 and 1:
// lengths around multiples of the piece size, receive buffers larger than the message, and two
// split messages with the same tag back to back.
int split(PointToPoint& p, const WorldArgs& w) {
  const size_t P = std::stoul(w.extra.at(0));
  const int peer = 1 - w.rank;
  const size_t sizes[] = {0, 1, P - 1, P, P + 1, 3 * P, 3 * P + 5, 100 * P + 17, (1u << 20) + 1};
  std::vector<std::vector<uint8_t>> in, out;
  std::vector<RequestPtr> recvs, sends;
  std::vector<std::pair<uint64_t, size_t>> expect;
  in.reserve(64);
  out.reserve(64);
  uint64_t tag = 1;
  for (size_t len : sizes) {
    for (size_t slack : {size_t{0}, size_t{3}, P, 2 * P + 9}) {
      in.emplace_back(len + slack);
      recvs.push_back(p.irecv(peer, tag, in.back().data(), len + slack));
      expect.emplace_back(tag, len);
      out.push_back(make_message(seed_of(w.rank, peer, tag), len));
      sends.push_back(p.isend(peer, tag, out.back().data(), len));
      ++tag;
    }
  }
  // Same tag twice: the second message must land in the second receive.
  const uint64_t same = 500;
  for (size_t len : {5 * P + 3, 4 * P + 1}) {
    in.emplace_back(8 * P);
    recvs.push_back(p.irecv(peer, same, in.back().data(), 8 * P));
    expect.emplace_back(same, len);
  }
  std::vector<uint8_t> a = make_message(seed_of(w.rank, peer, same), 5 * P + 3);
  std::vector<uint8_t> b = make_message(seed_of(w.rank, peer, same), 4 * P + 1);
  sends.push_back(p.isend(peer, same, a.data(), a.size()));
  sends.push_back(p.isend(peer, same, b.data(), b.size()));
  int failures = 0;
  for (size_t i = 0; i < recvs.size(); ++i) {
    recvs[i]->wait(soon());
    failures += check("split", peer, expect[i].first, in[i], expect[i].second, recvs[i]->bytes(), w.rank);
  }
  for (auto& s : sends) s->wait(soon());

  return failures ? 1 : 0;
}

// Rank 1 sends rank 0 a message longer than rank 0's receive buffer (split into pieces when
// extra[1] is "split"): rank 0's receive fails naming rank 1. The provider may drop the
// connection after a truncation (tcp does), so rank 1's send may complete or fail.
int truncation(PointToPoint& p, const WorldArgs& w) {
  const size_t P = std::stoul(w.extra.at(0));
  const size_t len = w.extra.at(1) == "split" ? 3 * P : P / 2;
  std::vector<uint8_t> big = make_message(1, len), small(len - 100);
  if (w.rank == 1) {
    try {
      p.isend(0, 9, big.data(), big.size())->wait(soon());
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kRemote) throw;
    }
    return 0;
  }
  try {
    p.irecv(1, 9, small.data(), small.size())->wait(soon());
  } catch (const Error& e) {
    std::string m = e.what();
    if (m.find(fmt::format("longer than the {}-byte receive buffer", small.size())) != std::string::npos &&
        m.find("rank 1 (host") != std::string::npos)
      return 0;
    std::printf("unexpected error: %s\n", e.what());
    return 1;
  }
  std::printf("a %zu-byte message fit in a %zu-byte buffer\n", len, small.size());
  return 1;
}

// Ranks 0 and 1 exchange 30 rounds of four sizes from the same buffers with every buffer
// registered (Options::force_mr_local, the FI_MR_LOCAL path EFA takes): data stays intact and
// the registration cache registers each buffer once, not once per message.
int registered(PointToPoint& p, const WorldArgs& w) {
  const int peer = 1 - w.rank;
  const size_t sizes[] = {1, 4096, 100000, 3u << 20};
  int failures = 0;
  std::vector<std::vector<uint8_t>> out, in;
  for (size_t len : sizes) {
    out.push_back(make_message(seed_of(w.rank, peer, len), len));
    in.emplace_back(len);
  }
  for (int round = 0; round < 30; ++round) {
    std::vector<RequestPtr> rs, ss;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      std::fill(in[i].begin(), in[i].end(), 0);
      rs.push_back(p.irecv(peer, i, in[i].data(), sizes[i]));
      ss.push_back(p.isend(peer, i, out[i].data(), sizes[i]));
    }
    for (size_t i = 0; i < std::size(sizes); ++i) {
      rs[i]->wait(soon());
      failures += check("registered", peer, sizes[i], in[i], sizes[i], rs[i]->bytes(), w.rank);
    }
    for (auto& s : ss) s->wait(soon());
  }
  auto* t = dynamic_cast<fabric::Transport*>(&p);
  const uint64_t regs = t ? t->registrations() : 0;
  std::printf("registrations: %lu\n", (unsigned long)regs);
  // 8 buffers, at most one registration each, plus the handshake's two and the peer watch's
  // standing receive (peer_watch.h).
  if (regs == 0 || regs > 2 * std::size(sizes) + 3) ++failures;
  return failures ? 1 : 0;
}

// One 256 MiB + 3 byte message each way, checked byte by byte; extra[0] > 0 forces pieces of
// that size.
int big(PointToPoint& p, const WorldArgs& w) {
  const int peer = 1 - w.rank;
  const size_t len = (256u << 20) + 3;
  std::vector<uint8_t> out = make_message(seed_of(w.rank, peer, 1), len), in(len);
  auto r = p.irecv(peer, 1, in.data(), len);
  auto s = p.isend(peer, 1, out.data(), len);
  r->wait(Deadline::after(120s));
  s->wait(Deadline::after(120s));
  return check("256 MiB", peer, 1, in, len, r->bytes(), w.rank);
}

}  // namespace

TRN_TEST_CHILD(registered) {
  fabric::Options o = fabric::Options::from_environment();
  o.force_mr_local = true;
  o.pull = false;  // long messages to same-host peers take libfabric, which registers them
  return run_child(args, o, registered);
}

TRN_TEST_CHILD(big) {
  fabric::Options o = fabric::Options::from_environment();
  o.max_piece = std::stoul(args.at(3));
  return run_child(args, o, big);
}

TRN_TEST_CHILD(truncation) {
  fabric::Options o = fabric::Options::from_environment();
  o.max_piece = std::stoul(args.at(3));
  return run_child(args, o, truncation);
}

TRN_TEST_CHILD(split) {
  fabric::Options o = fabric::Options::from_environment();
  o.max_piece = std::stoul(args.at(3));
  return run_child(args, o, split);
}

TRN_TEST_CHILD(exchange_all) { return run_child(args, fabric::Options::from_environment(), exchange_all); }
TRN_TEST_CHILD(many_outstanding) { return run_child(args, fabric::Options::from_environment(), many_outstanding); }

TEST_CASE("every rank exchanges 0 B..1 MiB messages with every other, receives before and after sends",
          "[integration]") {
  for (const auto& env : provider_envs()) {
    for (int n : {2, 4}) {
      INFO(env_name(env) << " ranks " << n);
      require_all_ok(run_world("exchange_all", n, env));
    }
  }
}

TEST_CASE("hundreds of outstanding operations complete, matched by tag", "[integration]") {
  for (const auto& env : provider_envs()) {
    INFO(env_name(env));
    require_all_ok(run_world("many_outstanding", 2, env));
  }
}

TEST_CASE("messages above the piece size are split and reassembled exactly", "[integration]") {
  for (const auto& env : provider_envs()) {
    INFO(env_name(env));
    require_all_ok(run_world("split", 2, env, {"4096"}));
  }
}

TEST_CASE("a message longer than the receive buffer fails the receive, naming the sender",
          "[integration]") {
  for (const auto& env : provider_envs()) {
    for (const char* mode : {"single", "split"}) {
      INFO(env_name(env) << mode);
      require_all_ok(run_world("truncation", 2, env, {"4096", mode}));
    }
  }
}

TEST_CASE("with registration required, buffers are registered once and reused", "[integration]") {
  for (const auto& env : provider_envs()) {
    INFO(env_name(env));
    auto rs = run_world("registered", 2, env);
    require_all_ok(rs);
  }
}

TEST_CASE("256 MiB messages arrive intact, whole and split into 64 MiB pieces", "[integration][slow]") {
  for (const auto& env : provider_envs()) {
    for (const char* piece : {"0", "67108864"}) {
      INFO(env_name(env) << " piece " << piece);
      require_all_ok(run_world("big", 2, env, {piece}, std::chrono::seconds(240)));
    }
  }
}
