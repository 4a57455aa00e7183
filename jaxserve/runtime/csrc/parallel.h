// Spread n independent work items over XLA's intra-op thread pool (and the calling thread), and
// the row chunks of a matmul's row groups (a grouped, mixture-of-experts call) as such items; the
// start of the handlers' XLA FFI bindings (the pool, then their float32 operand).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// Calls fn(i) once for each i in [0, n), on the caller and up to pool.num_threads() - 1 pool
// tasks, and returns when all are done. The state is owned jointly, so a pool task that starts
// after the call returned finds no work left and touches nothing of the caller's.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    explicit State(F f, int64_t count) : fn(std::move(f)), n(count) {}
    F fn;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
    void Drain() {
      for (int64_t i; (i = next.fetch_add(1)) < n;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (n <= 0) return;
  auto st = std::make_shared<State>(std::move(fn), n);
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st] { st->Drain(); });
  st->Drain();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
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
template <typename F>
void ForEachChunkPanel(xla::ffi::ThreadPool& pool, const RowChunks& chunks, int64_t panels, F fn) {
  const int64_t n = chunks.size();
  ParallelFor(pool, panels * n, [&](int64_t i) {
    int64_t group, r0, rows;
    chunks.At(i % n, group, r0, rows);
    fn(group, r0, rows, i / n);
  });
}

// The start of the kernels' FFI bindings: their handlers take XLA's intra-op thread pool (for
// ParallelFor) and then the float32 operand they compute from (x, or attention's q).
inline auto BindPoolF32() {
  return xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>().Arg<xla::ffi::Buffer<xla::ffi::F32>>();
}

}  // namespace jaxserve
