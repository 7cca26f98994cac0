#include "runtime/model/sharded.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/util/trace.h"

namespace trn::model {

// One post of a gather: the buckets over a range, and what arrives for them.
struct ShardedWeights::Part {
  optim::Range range;  // whole buckets
  bool packed = false;  // the bf16 wire (the header's "Under Precision::kBf16")
  bool form = false;    // the bf16 form of its matmul tensors is built on arrival
  std::vector<optim::Range> runs;  // the elements read in fp32, within range, sorted, disjoint
  size_t message = 0;              // packed: bf16s each rank sends (its longest message)
  SegmentStorage<float> f;                 // the fp32 wire: the whole range
  std::vector<SegmentStorage<float>> f32;  // packed: each run's values
  SegmentStorage<kernels::bf16> h;  // the bf16 form, oneDNN's
  SegmentStorage<float> w;          // the bf16 form widened (the emulated path)
  AlignedVector<kernels::bf16> send, wire;  // packed: this rank's message; every rank's
};

// One gather of a unit (or a range), with the uses it serves.
struct ShardedWeights::Gather {
  int unit = -1;            // -1: a range's
  std::vector<Part> parts;  // the unit's buckets, then the head's tied-embedding buckets
  int uses_left = 0;        // acquires still to come, over all its slots
  int holders = 0;          // acquired and not yet released
  bool issued = false;
  bool failed = false;  // a post threw: some parts never went out
  std::once_flag arrived;
  std::vector<WorkPtr> works;
  WeightView<float> view;
};

namespace {

// Calls fn(begin, end, run) for consecutive pieces covering s: run is the index of the run of
// `runs` (sorted, disjoint) holding the piece, or -1 between runs.
template <class Fn>
void walk(const std::vector<optim::Range>& runs, optim::Range s, Fn&& fn) {
  size_t at = s.begin;
  for (size_t i = 0; i < runs.size() && at < s.end; ++i) {
    const optim::Range& r = runs[i];
    if (r.end <= at) continue;
    if (r.begin >= s.end) break;
    if (r.begin > at) {
      fn(at, r.begin, -1);
      at = r.begin;
    }
    const size_t e = std::min(r.end, s.end);
    fn(at, e, int(i));
    at = e;
  }
  if (at < s.end) fn(at, s.end, -1);
}

// Sorted, merged ranges of a list (touching ranges join).
std::vector<optim::Range> merged(std::vector<optim::Range> v) {
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.begin < b.begin; });
  std::vector<optim::Range> out;
  for (const optim::Range& r : v) {
    if (r.begin == r.end) continue;
    if (!out.empty() && r.begin <= out.back().end) out.back().end = std::max(out.back().end, r.end);
    else out.push_back(r);
  }
  return out;
}

}  // namespace

ShardedWeights::ShardedWeights(const ParamLayout& lay, const optim::ZeroPlan& plan, std::shared_ptr<Communicator> comm,
                               int users, int prefetch)
    : lay_(lay), plan_(plan), comm_(std::move(comm)), users_(std::max(users, 1)), prefetch_(std::max(prefetch, 0)) {
  TRN_CHECK(comm_ && comm_->size() == plan_.dp() && plan_.size() == lay_.total());
  master_.assign(plan_.owned_elements(comm_->rank()), 0.0f);
  units_ = optim::units(lay_, plan_);
  std::vector<optim::Range> f32;
  for (const TensorSpec& t : lay_.tensors())
    if (!t.matmul) f32.push_back({t.offset, t.offset + t.numel});
  f32_tensors_ = merged(std::move(f32));
  std::vector<optim::Range> tables;
  // Only a chunk that looks tokens up reads its tables in fp32 (the last stage's copy of a tied
  // embedding is read by the head alone, in bf16).
  for (const optim::Unit& u : units_)
    if (u.kind == optim::Unit::Kind::kEmbedding && lay_.chunks()[size_t(u.chunk)].embedding)
      tables.push_back(u.tensors);
  tables_ = merged(std::move(tables));
  size_t block = 0;
  for (const optim::Unit& u : units_)
    if (u.kind == optim::Unit::Kind::kBlock) block = std::max(block, u.span.size());
  pooled_f_ = block + kBufferAlign / sizeof(float);
  // A packed message is a slice's elements and its fp32 elements' low halves, padded to the
  // longest rank's: within twice the unit.
  pooled_w_ = 2 * block + size_t(comm_->size()) * 2;
}

ShardedWeights::~ShardedWeights() { abandon(); }

void ShardedWeights::settle(std::vector<WorkPtr>& works) noexcept {
  for (WorkPtr& w : works) try {
      if (w) w->wait();
    } catch (...) {
      // Failed with the transport: it has stopped touching the buffer.
    }
}

template <typename T>
AlignedVector<T> ShardedWeights::take(std::vector<AlignedVector<T>>& pool, size_t n) {
  size_t best = pool.size();
  for (size_t i = 0; i < pool.size(); ++i)
    if (pool[i].capacity() >= n && (best == pool.size() || pool[i].capacity() < pool[best].capacity())) best = i;
  if (best == pool.size()) return {};
  AlignedVector<T> v = std::move(pool[best]);
  pool.erase(pool.begin() + ptrdiff_t(best));
  return v;
}

template <typename T>
void ShardedWeights::give(std::vector<AlignedVector<T>>& pool, AlignedVector<T>&& v, size_t limit) {
  if (v.capacity() == 0 || v.capacity() > limit) {
    AlignedVector<T>().swap(v);  // freed now (a moved-from or cleared vector may keep its storage)
    return;
  }
  pool.push_back(std::move(v));
  v = {};
  if (pool.size() > kPooled) {
    const auto smallest = std::min_element(pool.begin(), pool.end(),
                                           [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
    pool.erase(smallest);
  }
}

void ShardedWeights::recycle(Gather& g) {
  for (Part& p : g.parts) {
    give(pool_f_, p.f.take(), pooled_f_);
    give(pool_w_, std::move(p.wire), pooled_w_);
    p.f32.clear();  // a block's norms and biases: small, left to the allocator
    AlignedVector<kernels::bf16>().swap(p.send);
    p.w = {};
    p.h = {};
  }
  g.view = {};
}

int ShardedWeights::unit_of(Piece p) const {
  for (size_t i = 0; i < units_.size(); ++i) {
    const optim::Unit& u = units_[i];
    if (u.chunk != p.chunk) continue;
    const bool match = (p.kind == PieceKind::kBlock && u.kind == optim::Unit::Kind::kBlock && u.layer == p.layer) ||
                       (p.kind == PieceKind::kHead && u.kind == optim::Unit::Kind::kHead) ||
                       (p.kind == PieceKind::kEmbedding && u.kind == optim::Unit::Kind::kEmbedding);
    if (match) return int(i);
  }
  throw internal_error("no gather unit holds piece {} of chunk {} (layer {})", int(p.kind), p.chunk, p.layer);
}

std::vector<Piece> ShardedWeights::order_for(bool backward) const {
  TRN_CHECK(lay_.chunks().size() == 1);
  const Chunk& c = lay_.chunks()[0];
  std::vector<Piece> out;
  if (c.embedding) out.push_back({PieceKind::kEmbedding, 0, -1});
  for (int l = c.first_layer; l < c.end_layer; ++l) out.push_back({PieceKind::kBlock, 0, l});
  if (c.head) out.push_back({PieceKind::kHead, 0, -1});
  if (!backward) return out;
  if (c.head) out.push_back({PieceKind::kHead, 0, -1});
  for (int l = c.end_layer - 1; l >= c.first_layer; --l) out.push_back({PieceKind::kBlock, 0, l});
  return out;  // the embedding's backward reads no weight
}

void ShardedWeights::begin(const std::vector<Piece>& order) {
  std::lock_guard lock(mu_);
  TRN_CHECK(gathers_.empty() && slots_.empty());
  const bool bf16 = lay_.config().precision == Precision::kBf16;
  for (const Piece& p : order) {
    const int u = unit_of(p);
    const size_t n = slots_.size();
    if (n >= 1 && gathers_[slots_[n - 1].gather]->unit == u) {
      slots_[n - 1].uses_left += users_;  // the same unit again: the same slot
      gathers_[slots_[n - 1].gather]->uses_left += users_;
      continue;
    }
    if (n >= 2 && gathers_[slots_[n - 2].gather]->unit == u) {
      // One unit between (the head between the last block's forward and backward): the gather
      // stays for this slot instead of going and coming back.
      slots_.push_back({slots_[n - 2].gather, users_});
      gathers_[slots_[n - 2].gather]->uses_left += users_;
      continue;
    }
    const optim::Unit& unit = units_[size_t(u)];
    auto g = std::make_unique<Gather>();
    g->unit = u;
    const bool embedding = unit.kind == optim::Unit::Kind::kEmbedding;
    // The embedding's lookup reads its tables in fp32 only: no bf16 form for them.
    g->parts.push_back(plan_part(unit.span, embedding, bf16 && !embedding));
    if (unit.tied.size()) g->parts.push_back(plan_part(unit.tied, false, bf16));
    g->uses_left = users_;
    slots_.push_back({gathers_.size(), users_});
    gathers_.push_back(std::move(g));
  }
  issued_ = 0;
  try {
    if (!slots_.empty()) issue_through(std::min(size_t(prefetch_), slots_.size() - 1));
  } catch (...) {
    // The pass never starts: wait out what went out and drop it, so the next begin starts clean.
    for (const auto& g : gathers_) settle(g->works);
    gathers_.clear();
    slots_.clear();
    issued_ = 0;
    throw;
  }
}

void ShardedWeights::end() {
  std::lock_guard lock(mu_);
  for (const auto& g : gathers_)
    if (g->uses_left != 0 || g->holders != 0)
      throw internal_error("a pass ended with unit {} asked for {} more times and held {} times", g->unit,
                           g->uses_left, g->holders);
  gathers_.clear();
  slots_.clear();
  held_.clear();
  issued_ = 0;
}

void ShardedWeights::abandon() noexcept {
  std::lock_guard lock(mu_);
  for (auto* list : {&gathers_, &ranges_})
    for (const auto& g : *list)
      if (g) settle(g->works);
  gathers_.clear();
  slots_.clear();
  ranges_.clear();
  held_.clear();
  issued_ = 0;
}

void ShardedWeights::issue_through(size_t index) {
  for (; issued_ <= index && issued_ < slots_.size(); ++issued_) {
    Gather& g = *gathers_[slots_[issued_].gather];
    if (!g.issued) issue(g);
  }
}

ShardedWeights::Part ShardedWeights::plan_part(optim::Range range, bool tables, bool form) const {
  Part p;
  p.range = range;
  p.form = form;
  if (!form) return p;  // fp32 only: the fp32 wire
  std::vector<optim::Range> runs;
  for (const auto* list : {&f32_tensors_, tables ? &tables_ : nullptr})
    if (list)
      for (const optim::Range& r : *list) {
        const size_t b = std::max(r.begin, range.begin), e = std::min(r.end, range.end);
        if (b < e) runs.push_back({b, e});
      }
  p.runs = merged(std::move(runs));
  size_t whole = 0;
  for (const optim::Range& r : p.runs) whole += r.size();
  // Packed, an fp32 element costs two bf16s and a matmul element one: the bf16 wire carries
  // fewer bytes while at most half the elements are fp32 ones (in practice a block's or the
  // head's norms and biases: well under 1%).
  p.packed = 2 * whole <= range.size();
  if (!p.packed) p.runs.clear();
  return p;
}

void ShardedWeights::post(Part& p, std::vector<WorkPtr>& works) {
  const int r = comm_->rank(), n = comm_->size();
  const auto over = plan_.buckets_over(p.range.begin, p.range.end);
  const size_t first = over.first, last = over.second;
  if (!p.packed) {
    // Room for any alignment lead, so a pooled buffer serves every unit of its size.
    const size_t room = p.range.size() + kBufferAlign / sizeof(float);
    AlignedVector<float> v = take(pool_f_, room);
    if (v.capacity() < room) v.reserve(room);
    p.f = SegmentStorage<float>(p.range.begin, p.range.end, std::move(v));
    for (size_t k = first; k < last; ++k) {
      const optim::ZeroPlan::Bucket& b = plan_.buckets()[k];
      TRN_CHECK(b.begin >= p.range.begin && b.end <= p.range.end);
      float* at = p.f.data() + (b.begin - p.range.begin);
      const size_t q = b.slice, tail = plan_.tail(k), own = plan_.owned_offset(k, r);
      if (q) works.push_back(comm_->all_gather(master_.data() + own, at, q, DataType::kF32));
      if (tail) {
        float* t = at + q * size_t(n);
        if (r == n - 1) std::memcpy(t, master_.data() + own + q, sizeof(float) * tail);
        works.push_back(comm_->broadcast(t, tail, DataType::kF32, n - 1));
      }
    }
    stats_.bytes += double(p.range.size()) * sizeof(float);
    return;
  }
  // Rank j's message: the high halves of its slices' elements in order (a matmul element's
  // rounded to bf16, an fp32 element's truncated), then the low halves of its fp32 elements.
  // Every rank knows every message's length from the plan; all are padded to the longest.
  auto length = [&](int j) {
    size_t len = 0;
    for (size_t k = first; k < last; ++k) {
      const optim::Range s = plan_.slice(k, j);
      len += s.size();
      walk(p.runs, s, [&](size_t b, size_t e, int run) { len += run >= 0 ? e - b : 0; });
    }
    return len;
  };
  for (int j = 0; j < n; ++j) p.message = std::max(p.message, length(j));
  p.send.assign(p.message, kernels::bf16(0));
  const float* src = master_.data() + plan_.owned_offset(first, r);
  size_t hi = 0, lo = 0;
  for (size_t k = first; k < last; ++k) hi += plan_.slice(k, r).size();
  lo = hi;
  hi = 0;
  for (size_t k = first; k < last; ++k)
    walk(p.runs, plan_.slice(k, r), [&](size_t b, size_t e, int run) {
      if (run < 0) {
        kernels::round_to_bf16(p.send.data() + hi, src, e - b);
      } else {
        for (size_t i = 0; i < e - b; ++i) {
          uint32_t bits;
          std::memcpy(&bits, src + i, sizeof bits);
          p.send[hi + i] = kernels::bf16(bits >> 16);
          p.send[lo++] = kernels::bf16(bits & 0xffffu);
        }
      }
      src += e - b;
      hi += e - b;
    });
  p.wire = take(pool_w_, p.message * size_t(n));
  p.wire.resize(p.message * size_t(n));
  works.push_back(comm_->all_gather(p.send.data(), p.wire.data(), p.message, DataType::kBF16));
  stats_.bytes += double(p.message) * n * sizeof(kernels::bf16);
}

void ShardedWeights::issue(Gather& g) {
  // Issued once, even when a post fails part-way: its first parts' operations still write their
  // buffers, so posting again would free them under the transfer; the gather is failed instead
  // and its acquire throws (the pass is then abandoned, which waits them out).
  g.issued = true;
  try {
    for (Part& p : g.parts) post(p, g.works);
  } catch (...) {
    g.failed = true;
    throw;
  }
  ++stats_.gathers;
}

void ShardedWeights::finish(Part& p, WeightView<float>& view) const {
  const bool emulated = kernels::bf16_path() == kernels::Bf16Path::kEmulated;
  if (p.form) {
    if (emulated) p.w = SegmentStorage<float>(p.range.begin, p.range.end);
    else p.h = SegmentStorage<kernels::bf16>(p.range.begin, p.range.end);
  }
  // The bf16 form of elements [b, e) from their fp32 values at in, as Bf16Weights::refresh rounds.
  auto round = [&](size_t b, size_t e, const float* in) {
    if (emulated) {
      float* out = p.w.data() + (b - p.range.begin);
      std::memcpy(out, in, sizeof(float) * (e - b));
      kernels::round_through_bf16(out, nullptr, e - b);
    } else {
      kernels::round_to_bf16(p.h.data() + (b - p.range.begin), in, e - b);
    }
  };
  if (!p.packed) {
    view.add_f32(p.range.begin, p.range.end, p.f.data());
  } else {
    for (const optim::Range& r : p.runs) p.f32.emplace_back(r.begin, r.end);
    const auto over = plan_.buckets_over(p.range.begin, p.range.end);
    const size_t first = over.first, last = over.second;
    for (int j = 0; j < comm_->size(); ++j) {
      const kernels::bf16* msg = p.wire.data() + size_t(j) * p.message;
      size_t hi = 0, lo = 0;
      for (size_t k = first; k < last; ++k) lo += plan_.slice(k, j).size();
      for (size_t k = first; k < last; ++k)
        walk(p.runs, plan_.slice(k, j), [&](size_t b, size_t e, int run) {
          if (run < 0) {
            // Matmul elements (or padding): the arrived bf16 is the form.
            if (emulated) kernels::widen_bf16(p.w.data() + (b - p.range.begin), msg + hi, e - b);
            else std::memcpy(p.h.data() + (b - p.range.begin), msg + hi, sizeof(kernels::bf16) * (e - b));
          } else {
            float* out = p.f32[size_t(run)].data() + (b - p.runs[size_t(run)].begin);
            for (size_t i = 0; i < e - b; ++i) {
              const uint32_t bits = uint32_t(msg[hi + i]) << 16 | msg[lo++];
              std::memcpy(out + i, &bits, sizeof bits);
            }
          }
          hi += e - b;
        });
    }
    for (size_t i = 0; i < p.runs.size(); ++i) view.add_f32(p.runs[i].begin, p.runs[i].end, p.f32[i].data());
  }
  if (!p.form) return;
  // On the fp32 wire the matmul tensors are rounded from their fp32 values here. On the packed one
  // the matmul elements arrived rounded; a matmul tensor inside a run is an embedding table of a
  // chunk that looks tokens up, which reads it in fp32 only (such a chunk holds no head when it is
  // a range, and a unit's tied part is sent without tables), so no form of it is read.
  if (!p.packed)
    for (const TensorSpec& t : lay_.tensors()) {
      if (!t.matmul) continue;
      const size_t b = std::max(t.offset, p.range.begin), e = std::min(t.offset + t.numel, p.range.end);
      if (b < e) round(b, e, p.f.data() + (b - p.range.begin));
    }
  if (emulated) view.add_bf16(p.range.begin, p.range.end, kernels::Bf16Src::widened(p.w.data()));
  else view.add_bf16(p.range.begin, p.range.end, kernels::Bf16Src{p.h.data()});
}

void ShardedWeights::arrive(Gather& g) {
  for (WorkPtr& w : g.works) w->wait();
  if (g.failed) throw internal_error("a weight gather whose posting failed was asked for");
  if (!g.works.empty()) {
    const auto first = g.works.front()->ran().first, last = g.works.back()->ran().second;
    std::lock_guard lock(mu_);
    stats_.busy_s += std::chrono::duration<double>(last - first).count();
  }
  g.works.clear();
  for (Part& p : g.parts) AlignedVector<kernels::bf16>().swap(p.send);  // sent: freed before unpacking
  WeightView<float> v;
  for (Part& p : g.parts) finish(p, v);
  g.view = std::move(v);
  std::lock_guard lock(mu_);
  for (Part& p : g.parts) give(pool_w_, std::move(p.wire), pooled_w_);  // unpacked: serves the next gather
}

const WeightView<float>& ShardedWeights::acquire(Piece p) {
  const int u = unit_of(p);
  Gather* g = nullptr;
  {
    std::lock_guard lock(mu_);
    size_t i = 0;
    while (i < slots_.size() && !(gathers_[slots_[i].gather]->unit == u && slots_[i].uses_left > 0)) ++i;
    if (i == slots_.size())
      throw internal_error("piece {} of chunk {} (layer {}) asked for outside its pass's order", int(p.kind), p.chunk,
                           p.layer);
    g = gathers_[slots_[i].gather].get();
    --slots_[i].uses_left;
    --g->uses_left;
    ++g->holders;
    held_.emplace_back(std::this_thread::get_id(), slots_[i].gather);
    issue_through(std::min(i + size_t(prefetch_), slots_.size() - 1));
  }
  return await(*g);
}

const WeightView<float>& ShardedWeights::await(Gather& g) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    trace::Span span("wait: gather weights", "dp", {{"at", int64_t(g.parts.front().range.begin)}});
    std::call_once(g.arrived, [&] { arrive(g); });
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard lock(mu_);
  stats_.exposed_s += waited;
  return g.view;
}

void ShardedWeights::release(Piece p) noexcept {
  (void)p;
  std::lock_guard lock(mu_);
  const auto me = std::this_thread::get_id();
  const auto it = std::find_if(held_.begin(), held_.end(), [&](const auto& h) { return h.first == me; });
  if (it == held_.end()) return;  // abandoned meanwhile
  Gather& g = *gathers_[it->second];
  held_.erase(it);
  if (--g.holders == 0 && g.uses_left == 0) {
    // Every use is done: the buffers go back to the pool (the Gather stays for end()'s check).
    recycle(g);
  }
}

ShardedWeights::RangeHandle ShardedWeights::issue_range(size_t begin, size_t end) {
  TRN_CHECK(begin < end && end <= lay_.total());
  auto g = std::make_unique<Gather>();
  const auto [first, last] = plan_.buckets_over(begin, end);
  g->parts.push_back(plan_part(plan_.span(first, last), true, lay_.config().precision == Precision::kBf16));
  g->uses_left = 1;
  std::lock_guard lock(mu_);
  try {
    issue(*g);
  } catch (...) {
    settle(g->works);  // the operations issued before the failure still write g's buffers
    throw;
  }
  size_t h = 0;
  while (h < ranges_.size() && ranges_[h]) ++h;
  if (h == ranges_.size()) ranges_.emplace_back();
  ranges_[h] = std::move(g);
  return h;
}

const WeightView<float>& ShardedWeights::wait(RangeHandle h) {
  Gather* g = nullptr;
  {
    std::lock_guard lock(mu_);
    if (h >= ranges_.size() || !ranges_[h]) throw internal_error("wait for range gather {}, which is not issued", h);
    g = ranges_[h].get();
  }
  return await(*g);
}

void ShardedWeights::free(RangeHandle h) noexcept {
  std::unique_ptr<Gather> g;
  {
    std::lock_guard lock(mu_);
    if (h >= ranges_.size() || !ranges_[h]) return;  // abandoned meanwhile
    g = std::move(ranges_[h]);
  }
  settle(g->works);  // a range freed before it was waited for: its transfers still write the buffers
  std::lock_guard lock(mu_);
  recycle(*g);
}

void ShardedWeights::gather_whole(float* whole) {
  trace::Span span("dp all-gather weights (whole)", "dp");
  const int r = comm_->rank(), n = comm_->size();
  std::vector<WorkPtr> works;
  try {
    for (size_t k = 0; k < plan_.buckets().size(); ++k) {
      const optim::ZeroPlan::Bucket& b = plan_.buckets()[k];
      const size_t q = b.slice, tail = plan_.tail(k), own = plan_.owned_offset(k, r);
      if (q) works.push_back(comm_->all_gather(master_.data() + own, whole + b.begin, q, DataType::kF32));
      if (tail) {
        float* t = whole + b.begin + q * size_t(n);
        if (r == n - 1) std::memcpy(t, master_.data() + own + q, sizeof(float) * tail);
        works.push_back(comm_->broadcast(t, tail, DataType::kF32, n - 1));
      }
    }
    for (WorkPtr& w : works) w->wait();
  } catch (...) {
    settle(works);  // the caller's buffer goes with the error: nothing may still write it
    throw;
  }
}

void ShardedWeights::keep_owned(const float* whole) {
  size_t at = 0;
  for (const optim::Range& r : plan_.owned(comm_->rank())) {
    std::memcpy(master_.data() + at, whole + r.begin, sizeof(float) * r.size());
    at += r.size();
  }
  TRN_CHECK(at == master_.size());
}

}  // namespace trn::model
