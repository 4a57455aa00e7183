// Spread n independent work items over XLA's intra-op thread pool (and the calling thread), and
// the row chunks of a matmul's row groups (a grouped, mixture-of-experts call) as such items; the
// start of the handlers' XLA FFI bindings (the pool, then their float32 operand).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <sched.h>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Runs st->Drain() on the caller and `helpers` pool tasks, and returns once st->done reaches
// `total`. The state is owned jointly, so a pool task that starts after the call returned finds no
// work left and touches nothing of the caller's.
template <typename State>
void DrainOnThreads(xla::ffi::ThreadPool& pool, std::shared_ptr<State> st, int64_t helpers, int64_t total) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st] { st->Drain(); });
  st->Drain();
  while (st->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

// Calls fn(i) once for each i in [0, n), on the caller and up to pool.num_threads() - 1 pool
// tasks (DrainOnThreads), and returns when all are done.
// Items claimed one at a time suit items of unequal cost (attention's, sorted costliest first).
// `uniform` items (a matmul's tiles, rows to convert) are claimed a share of what is left at a time
// (guided self-scheduling): a few claims per thread and call instead of one per item. Each claim and
// each count of finished items moves a cache line between the cores, ~350 ns on a VM whose two vCPUs
// sit far apart (bench/core_link.py).
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F fn, bool uniform = false) {
  struct State {
    State(F f, int64_t count, int64_t divisor) : fn(std::move(f)), n(count), div(divisor) {}
    F fn;
    int64_t n, div;  // div: a claim takes 1 / div of the items left (0: one item)
    alignas(64) std::atomic<int64_t> next{0};  // claims and the caller's wait: separate lines
    alignas(64) std::atomic<int64_t> done{0};
    void Drain() {
      int64_t mine = 0;
      for (int64_t i = next.load(std::memory_order_relaxed); i < n;) {
        int64_t take = 1;
        if (div == 0) {
          i = next.fetch_add(1, std::memory_order_relaxed);
        } else {
          take = std::max<int64_t>(1, (n - i) / div);
          if (!next.compare_exchange_weak(i, i + take, std::memory_order_relaxed)) continue;
        }
        if (i >= n) break;
        take = std::min(take, n - i);
        for (int64_t j = i; j < i + take; ++j) fn(j);
        mine += take;
        i = next.load(std::memory_order_relaxed);
      }
      if (mine) done.fetch_add(mine, std::memory_order_release);
    }
  };
  if (n <= 0) return;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  DrainOnThreads(pool, std::make_shared<State>(std::move(fn), n, uniform ? 2 * (helpers + 1) : 0), helpers, n);
}

// Calls fn(u, k) for each unit u < bounds.back() and k < per_unit, the units in w =
// bounds.size() - 1 contiguous shares (share s: [bounds[s], bounds[s + 1])), one per participant
// (the caller and pool tasks; w <= the pool's threads); within a share k is the outer loop. Each
// participant first drains the share numbered after the CPU it runs on (sched_getcpu() % w), so
// the same core takes the same units call after call and the rows it wrote stay in its caches; then
// it takes what is left of the others' (a participant descheduled mid-call delays nobody). On a VM
// whose vCPUs sit far apart (bench/core_link.py: ~350 ns a cache line's round trip) a prefill burst
// runs ~30% slower than with them near, mostly in reads of lines the other core wrote; with a
// matmul's rows dealt to whichever thread asked next, half its rows were such lines (shares: -3%
// near, -5% far on that burst).
template <typename F>
void ParallelShares(xla::ffi::ThreadPool& pool, const std::vector<int64_t>& bounds, int64_t per_unit, F fn) {
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};
    int64_t first = 0, len = 0;  // its units
  };
  struct State {
    State(F f, int64_t shares, int64_t per) : fn(std::move(f)), w(shares), per_unit(per), share(new Share[shares]) {}
    F fn;
    int64_t w, per_unit;
    std::unique_ptr<Share[]> share;
    alignas(64) std::atomic<int64_t> done{0};
    void Drain() {
      const int cpu = sched_getcpu();
      const int64_t start = cpu < 0 ? 0 : cpu % w;
      int64_t mine = 0;
      for (int64_t k = 0; k < w; ++k) {
        Share& sh = share[(start + k) % w];
        for (int64_t j; (j = sh.next.fetch_add(1, std::memory_order_relaxed)) < sh.len * per_unit; ++mine)
          fn(sh.first + j % sh.len, j / sh.len);
      }
      if (mine) done.fetch_add(mine, std::memory_order_release);
    }
  };
  const int64_t w = int64_t(bounds.size()) - 1, units = w > 0 ? bounds.back() - bounds.front() : 0;
  if (units <= 0 || per_unit <= 0) return;
  auto st = std::make_shared<State>(std::move(fn), w, per_unit);
  for (int64_t s = 0; s < w; ++s) st->share[s].first = bounds[s], st->share[s].len = bounds[s + 1] - bounds[s];
  DrainOnThreads(pool, st, w - 1, units * per_unit);
}

// ParallelShares over `units` split evenly into w = min(threads, units) shares.
template <typename F>
void ParallelShares(xla::ffi::ThreadPool& pool, int64_t units, int64_t per_unit, F fn) {
  const int64_t w = std::min<int64_t>(pool.num_threads(), units);
  std::vector<int64_t> bounds;
  for (int64_t s = 0; s <= w; ++s) bounds.push_back(units * s / std::max<int64_t>(w, 1));
  ParallelShares(pool, bounds, per_unit, std::move(fn));
}

// The calls between two matmuls (the KV write, attention) deal their items by the matmuls' row
// shares, so a row is read on the core that wrote it. fn(i) for each item i whose rows begin at
// first_row[i] of the call's m: a call of at least one AVX-512 row chunk (kShareChunkRows) per
// thread, as a prefill matmul runs in shares (ForEachChunkPanel), splits the rows evenly into
// shares as the matmuls do (to within a row chunk), and each participant drains its CPU's share in
// the items' order (costliest first), then what is left of the others' (ParallelShares); a decode
// step's few rows go to whichever thread asks (ParallelFor), as its matmuls' do.
constexpr int64_t kShareChunkRows = 48;  // dot_matmul.h's kRowChunk
template <typename F>
void ForEachInRowShares(xla::ffi::ThreadPool& pool, const std::vector<int64_t>& first_row, int64_t m, F fn) {
  const int64_t n = first_row.size(), threads = pool.num_threads();
  const int64_t w = (m + kShareChunkRows - 1) / kShareChunkRows >= threads ? std::min(threads, n) : 1;
  if (w <= 1) return ParallelFor(pool, n, fn);
  std::vector<int64_t> order, bounds{0};
  order.reserve(n);
  for (int64_t s = 0; s < w; ++s) {
    for (int64_t i = 0; i < n; ++i)
      if (std::clamp<int64_t>(first_row[i] * w / m, 0, w - 1) == s) order.push_back(i);
    bounds.push_back(order.size());
  }
  ParallelShares(pool, bounds, 1, [&](int64_t u, int64_t) { fn(order[u]); });
}

// A matmul's rows as groups, each multiplied by its own weight: group g is rows [start(g),
// start(g) + rows[g]) (rows sorted by group, as a mixture-of-experts layer sorts its tokens by
// expert), cut into chunks of at most `chunk` rows; a plain matmul is one group. Chunk c's group,
// first row and rows: `At`. Groups of no rows have no chunks (an expert no token chose costs nothing).
class RowChunks {
 public:
  RowChunks(const int64_t* rows, int64_t groups, int64_t chunk) : chunk_(chunk) {
    int64_t r = 0, c = 0;
    for (int64_t g = 0; g < groups; ++g) {
      start_.push_back(r);
      r += rows[g];
      c += (rows[g] + chunk - 1) / chunk;
      end_.push_back(c);
    }
    rows_ = r;
  }
  int64_t size() const { return end_.empty() ? 0 : end_.back(); }
  int64_t rows() const { return rows_; }  // all groups' rows
  void At(int64_t c, int64_t& group, int64_t& r0, int64_t& rows) const {
    group = std::upper_bound(end_.begin(), end_.end(), c) - end_.begin();
    const int64_t first = group ? end_[group - 1] : 0, group_end = group + 1 < int64_t(start_.size())
                                                                         ? start_[group + 1] : rows_;
    r0 = start_[group] + (c - first) * chunk_;
    rows = std::min(chunk_, group_end - r0);
  }

 private:
  int64_t chunk_, rows_ = 0;
  std::vector<int64_t> start_, end_;  // each group's first row; cumulative chunks through it
};

// A matmul's work items (row chunk, weight panel), row chunks fastest: a panel's weights are read
// from memory once and stay in cache while its row chunks pass (the rows, a few hundred KiB, stay
// in L2 across panels); panels fastest read every weight again per row chunk. fn(group, first row,
// rows, panel) for each.
// With at least as many row chunks as threads (prefill), each thread's share is a range of row
// chunks (ParallelShares), the same rows call after call; with fewer (decode), the items go to
// whichever thread asks next.
template <typename F>
void ForEachChunkPanel(xla::ffi::ThreadPool& pool, const RowChunks& chunks, int64_t panels, F fn) {
  const int64_t n = chunks.size();
  const auto item = [&](int64_t chunk, int64_t panel) {
    int64_t group, r0, rows;
    chunks.At(chunk, group, r0, rows);
    fn(group, r0, rows, panel);
  };
  if (n < pool.num_threads()) {
    ParallelFor(pool, panels * n, [&](int64_t i) { item(i % n, i / n); }, /*uniform=*/true);
    return;
  }
  ParallelShares(pool, n, panels, item);  // a share: a range of chunks, each panel's in turn
}

// The start of the kernels' FFI bindings: their handlers take XLA's intra-op thread pool (for
// ParallelFor) and then the float32 operand they compute from (x, or attention's q).
inline auto BindPoolF32() {
  return xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>().Arg<xla::ffi::Buffer<xla::ffi::F32>>();
}

}  // namespace jaxserve
