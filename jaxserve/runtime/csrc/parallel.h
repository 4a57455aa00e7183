// Spread n independent work items over XLA's intra-op thread pool (and the calling thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

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

}  // namespace jaxserve
