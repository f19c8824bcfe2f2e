// Work split over XLA's intra-op thread pool, shared by the native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace research_native {

// The cores this process may run on (its affinity mask where the OS says; XLA's intra-op pool
// can hold more threads than that, and a helper per extra thread only takes turns on a core).
inline int64_t usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

// Runs fn(begin, end) over [0, units) in `chunks` contiguous pieces, claimed from a shared
// counter by this thread and the pool's: this thread never waits on a piece nobody has claimed,
// and a task that starts late finds none left (the state it touches is shared, so it outlives
// this call). Helpers: one per usable core beyond this thread's, at most.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t units, int64_t chunks_per_thread, Fn fn) {
  static const int64_t cores = usable_cores();
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>({pool.num_threads(), cores - 1, units - 1}));
  if (helpers == 0) {
    fn(int64_t{0}, units);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  const int64_t chunks = std::min<int64_t>(units, chunks_per_thread * (helpers + 1));
  auto worker = [state, fn, chunks, units] {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      fn(units * c / chunks, units * (c + 1) / chunks);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

}  // namespace research_native
