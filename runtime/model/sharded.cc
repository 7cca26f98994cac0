#include "runtime/model/sharded.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "collectives/core/error.h"
#include "runtime/kernels/bf16.h"
#include "runtime/util/trace.h"

namespace trn::model {

// One gather of a unit in the pass's order, with the uses it serves.
struct ShardedWeights::Gather {
  int unit = -1;                       // -1: a range's
  optim::Range span_range, tied_range;  // whole buckets; tied empty when none
  int uses_left = 0;  // acquires still to come
  int holders = 0;    // acquired and not yet released
  bool issued = false;
  std::once_flag arrived;
  SegmentStorage<float> span, tied;  // the unit's buckets; the head's tied-embedding buckets
  SegmentStorage<kernels::bf16> span_h, tied_h;  // bf16 forms: oneDNN's
  SegmentStorage<float> span_w, tied_w;          // the emulated path's (bf16 values widened)
  std::vector<WorkPtr> works;
  WeightView<float> view;
};

ShardedWeights::ShardedWeights(const ParamLayout& lay, const optim::ZeroPlan& plan, std::shared_ptr<Communicator> comm,
                               int users, int prefetch)
    : lay_(lay), plan_(plan), comm_(std::move(comm)), users_(std::max(users, 1)), prefetch_(std::max(prefetch, 0)) {
  TRN_CHECK(comm_ && comm_->size() == plan_.dp() && plan_.size() == lay_.total());
  master_.assign(plan_.owned_elements(comm_->rank()), 0.0f);
  units_ = optim::units(lay_, plan_);
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
void ShardedWeights::give(std::vector<AlignedVector<T>>& pool, SegmentStorage<T>& s) {
  AlignedVector<T> v = s.take();
  if (v.capacity() == 0) return;
  pool.push_back(std::move(v));
  if (pool.size() > kPooled) {
    const auto smallest = std::min_element(pool.begin(), pool.end(),
                                           [](const auto& a, const auto& b) { return a.capacity() < b.capacity(); });
    pool.erase(smallest);
  }
}

void ShardedWeights::recycle(Gather& g) {
  give(pool_f_, g.span);
  give(pool_f_, g.tied);
  g.span_w = {};
  g.tied_w = {};
  g.span_h = {};
  g.tied_h = {};
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
  TRN_CHECK(gathers_.empty());
  for (const Piece& p : order) {
    const int u = unit_of(p);
    if (!gathers_.empty() && gathers_.back()->unit == u) {
      gathers_.back()->uses_left += users_;  // consecutive uses share one gather
      continue;
    }
    gathers_.push_back(std::make_unique<Gather>());
    gathers_.back()->unit = u;
    gathers_.back()->span_range = units_[size_t(u)].span;
    gathers_.back()->tied_range = units_[size_t(u)].tied;
    gathers_.back()->uses_left = users_;
  }
  issued_ = 0;
  if (!gathers_.empty()) issue_through(std::min(size_t(prefetch_), gathers_.size() - 1));
}

void ShardedWeights::end() {
  std::lock_guard lock(mu_);
  for (const auto& g : gathers_)
    if (g->uses_left != 0 || g->holders != 0)
      throw internal_error("a pass ended with unit {} asked for {} more times and held {} times", g->unit,
                           g->uses_left, g->holders);
  gathers_.clear();
  held_.clear();
  issued_ = 0;
}

void ShardedWeights::abandon() noexcept {
  std::lock_guard lock(mu_);
  for (auto* list : {&gathers_, &ranges_})
    for (const auto& g : *list)
      if (g) settle(g->works);
  gathers_.clear();
  ranges_.clear();
  held_.clear();
  issued_ = 0;
}

void ShardedWeights::issue_through(size_t index) {
  for (; issued_ <= index && issued_ < gathers_.size(); ++issued_) issue(*gathers_[issued_]);
}

void ShardedWeights::issue(Gather& g) {
  const int r = comm_->rank(), n = comm_->size();
  auto post = [&](SegmentStorage<float>& buf, optim::Range range) {
    buf = SegmentStorage<float>(range.begin, range.end, take(pool_f_, range.size() + kBufferAlign / sizeof(float)));
    const auto [first, last] = plan_.buckets_over(range.begin, range.end);
    for (size_t k = first; k < last; ++k) {
      const optim::ZeroPlan::Bucket& b = plan_.buckets()[k];
      TRN_CHECK(b.begin >= range.begin && b.end <= range.end);
      float* at = buf.data() + (b.begin - range.begin);
      const size_t q = b.slice, tail = plan_.tail(k), own = plan_.owned_offset(k, r);
      if (q) g.works.push_back(comm_->all_gather(master_.data() + own, at, q, DataType::kF32));
      if (tail) {
        float* t = at + q * size_t(n);
        if (r == n - 1) std::memcpy(t, master_.data() + own + q, sizeof(float) * tail);
        g.works.push_back(comm_->broadcast(t, tail, DataType::kF32, n - 1));
      }
    }
    stats_.bytes += double(range.size()) * sizeof(float);
  };
  post(g.span, g.span_range);
  if (g.tied_range.size()) post(g.tied, g.tied_range);
  ++stats_.gathers;
  g.issued = true;
}

void ShardedWeights::arrive(Gather& g) {
  for (WorkPtr& w : g.works) w->wait();
  if (!g.works.empty()) {
    const auto first = g.works.front()->ran().first, last = g.works.back()->ran().second;
    std::lock_guard lock(mu_);
    stats_.busy_s += std::chrono::duration<double>(last - first).count();
  }
  g.works.clear();
  WeightView<float> v;
  v.add_f32(g.span.begin(), g.span.end(), g.span.data());
  if (g.tied.size()) v.add_f32(g.tied.begin(), g.tied.end(), g.tied.data());
  if (lay_.config().precision == Precision::kBf16) {
    // The matmul tensors' elements in the buffer's range, rounded as Bf16Weights::refresh rounds
    // them (elementwise; the rest of the form is never read).
    const bool emulated = kernels::bf16_path() == kernels::Bf16Path::kEmulated;
    auto round = [&](const SegmentStorage<float>& src, SegmentStorage<kernels::bf16>& h, SegmentStorage<float>& f) {
      // The bf16 forms are not pooled: measured, pooling them beside the fp32 units held more.
      if (emulated) f = SegmentStorage<float>(src.begin(), src.end());
      else h = SegmentStorage<kernels::bf16>(src.begin(), src.end());
      for (const TensorSpec& t : lay_.tensors()) {
        if (!t.matmul) continue;
        const size_t b = std::max(t.offset, src.begin()), e = std::min(t.offset + t.numel, src.end());
        if (b >= e) continue;
        const float* in = src.data() + (b - src.begin());
        if (emulated) {
          float* out = f.data() + (b - src.begin());
          std::memcpy(out, in, sizeof(float) * (e - b));
          kernels::round_through_bf16(out, nullptr, e - b);
        } else {
          kernels::round_to_bf16(h.data() + (b - src.begin()), in, e - b);
        }
      }
      if (emulated) v.add_bf16(src.begin(), src.end(), kernels::Bf16Src::widened(f.data()));
      else v.add_bf16(src.begin(), src.end(), kernels::Bf16Src{h.data()});
    };
    round(g.span, g.span_h, g.span_w);
    if (g.tied.size()) round(g.tied, g.tied_h, g.tied_w);
  }
  g.view = std::move(v);
}

const WeightView<float>& ShardedWeights::acquire(Piece p) {
  const int u = unit_of(p);
  Gather* g = nullptr;
  {
    std::lock_guard lock(mu_);
    size_t i = 0;
    while (i < gathers_.size() && !(gathers_[i]->unit == u && gathers_[i]->uses_left > 0)) ++i;
    if (i == gathers_.size())
      throw internal_error("piece {} of chunk {} (layer {}) asked for outside its pass's order", int(p.kind), p.chunk,
                           p.layer);
    g = gathers_[i].get();
    --g->uses_left;
    ++g->holders;
    held_.emplace_back(std::this_thread::get_id(), i);
    issue_through(std::min(i + size_t(prefetch_), gathers_.size() - 1));
  }
  return await(*g);
}

const WeightView<float>& ShardedWeights::await(Gather& g) {
  const auto t0 = std::chrono::steady_clock::now();
  {
    trace::Span span("wait: gather weights", "dp", {{"at", int64_t(g.span_range.begin)}});
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
  g->span_range = plan_.span(first, last);
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

void ShardedWeights::gather_whole(float* whole, bool counted) {
  trace::Span span("dp all-gather weights (whole)", "dp");
  const int r = comm_->rank(), n = comm_->size();
  std::vector<WorkPtr> works;
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
  const auto t0 = std::chrono::steady_clock::now();
  for (WorkPtr& w : works) w->wait();
  if (!counted) return;
  std::lock_guard lock(mu_);
  ++stats_.gathers;
  stats_.bytes += double(plan_.size()) * sizeof(float);
  stats_.exposed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!works.empty())
    stats_.busy_s += std::chrono::duration<double>(works.back()->ran().second - works.front()->ran().first).count();
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
