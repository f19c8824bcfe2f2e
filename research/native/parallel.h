// Work split over this process's cores, shared by the native kernels.
//
// A decode step calls the kernels ~150 times, tens of microseconds each, a few microseconds
// apart. Handing each call's pieces to XLA's intra-op pool woke a sleeping thread per call, and
// the wake took a sizeable part of the call (two cores: the step's projections read their
// weights at 0.70 of a plain read of the same bytes, against 0.85 on one core). So the kernels
// share one pool of their own, one helper per usable core beyond the caller's, that spins for
// a short while after each piece of work (pausing, and yielding the core to anything else
// runnable) before it sleeps: within a step a helper is already awake when the next call
// comes.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
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

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t process_id() {
#if defined(__linux__)
  return static_cast<int64_t>(getpid());
#else
  return 0;
#endif
}

// One job at a time: the caller publishes (function, context, units, chunks) and a ticket
// word {generation:32, next chunk:16, chunks:16}; every thread claims chunks by compare-and-swap
// on the ticket, so a helper that wakes late, or still holds an old generation, claims nothing
// (and reads the job only after a claim succeeds, while its caller cannot move on). A caller
// that finds the pool busy (XLA ran two kernels at once) runs its work alone.
class SpinPool {
 public:
  using Call = void (*)(void*, int64_t, int64_t);
  static constexpr int64_t kMaxChunks = 0xFFFF;
  static constexpr std::chrono::microseconds kSpin{300};

  explicit SpinPool(int64_t helpers) : helpers_(helpers), pid_(process_id()) {
    for (int64_t i = 0; i < helpers; ++i) std::thread([this] { helper(); }).detach();
  }

  // The process's pool (a GNU unique object: one for every library that includes this header;
  // a forked child, whose helpers did not survive the fork, builds its own). Never destroyed:
  // its detached helpers may outlive static destruction at exit.
  static SpinPool& instance() {
    static std::atomic<SpinPool*> pool{nullptr};
    static std::mutex mu;
    SpinPool* p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != process_id()) {
      std::lock_guard<std::mutex> lock(mu);
      p = pool.load(std::memory_order_relaxed);
      if (p == nullptr || p->pid_ != process_id()) {
        p = new SpinPool(usable_cores() - 1);
        pool.store(p, std::memory_order_release);
      }
    }
    return *p;
  }

  int64_t helpers() const { return helpers_; }

  // fn(begin, end) over [0, units) in `chunks` contiguous pieces; returns when all are done.
  void run(int64_t units, int64_t chunks, Call call, void* ctx) {
    if (busy_.exchange(true, std::memory_order_acquire)) {
      call(ctx, 0, units);
      return;
    }
    chunks = std::min<int64_t>(chunks, kMaxChunks);
    call_ = call;
    ctx_ = ctx;
    units_ = units;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = ++generation_;
    ticket_.store((gen << 32) | static_cast<uint64_t>(chunks), std::memory_order_release);
    published_.store(static_cast<uint32_t>(gen), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_all();
    }
    work(static_cast<uint32_t>(gen));
    while (done_.load(std::memory_order_acquire) < chunks) cpu_relax();
    busy_.store(false, std::memory_order_release);
  }

 private:
  // Claims and runs chunks of generation `gen` until none is left.
  void work(uint32_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(t >> 32) != gen) return;
      const int64_t next = static_cast<int64_t>((t >> 16) & 0xFFFF);
      const int64_t chunks = static_cast<int64_t>(t & 0xFFFF);
      if (next >= chunks) return;
      if (!ticket_.compare_exchange_weak(t, t + (uint64_t{1} << 16), std::memory_order_acq_rel,
                                         std::memory_order_acquire))
        continue;
      call_(ctx_, units_ * next / chunks, units_ * (next + 1) / chunks);
      done_.fetch_add(1, std::memory_order_release);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void helper() {
    uint32_t seen = published_.load(std::memory_order_acquire);
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      for (int spins = 1; published_.load(std::memory_order_acquire) == seen; ++spins) {
        cpu_relax();
        if (spins % 64 != 0) continue;
        std::this_thread::yield();  // anything else runnable on this core goes first
        if (std::chrono::steady_clock::now() - start < kSpin) continue;
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return published_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = published_.load(std::memory_order_acquire);
      work(seen);
    }
  }

  const int64_t helpers_;
  const int64_t pid_;
  std::atomic<bool> busy_{false};
  uint64_t generation_ = 0;  // written by the caller holding busy_
  Call call_ = nullptr;
  void* ctx_ = nullptr;
  int64_t units_ = 0;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> published_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;
  std::condition_variable wake_;
};

// Nanoseconds this library's kernels have spent in parallel_for (wall clock on the calling
// thread, the helpers' share included), since it was loaded: the engine takes it from a step's
// time in its jitted calls to see XLA's own work between the kernels (research_kernel_ns).
// One counter per library (internal linkage: a function-local static of an inline function
// would be a unique symbol that the loader shares between libraries).
namespace {
std::atomic<int64_t> kernel_ns_total{0};
}  // namespace
inline std::atomic<int64_t>& kernel_ns() { return kernel_ns_total; }

// Runs fn(begin, end) over [0, units) in contiguous pieces (`chunks_per_thread` per thread)
// on this thread and the process pool's helpers; where XLA's pool has no threads (the user
// asked for one), everything runs here. The call's wall time goes to kernel_ns.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t units, int64_t chunks_per_thread, Fn fn) {
  const auto start = std::chrono::steady_clock::now();
  SpinPool* spin = units <= 1 || pool.num_threads() == 0 ? nullptr : &SpinPool::instance();
  if (spin == nullptr || spin->helpers() == 0) {
    if (units > 0) fn(int64_t{0}, units);
  } else {
    const int64_t chunks = std::min<int64_t>(units, chunks_per_thread * (spin->helpers() + 1));
    spin->run(units, chunks,
              [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Fn*>(ctx))(begin, end); },
              &fn);
  }
  kernel_ns().fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count(),
      std::memory_order_relaxed);
}

}  // namespace research_native

// The library's kernel time so far (research_native::kernel_ns), for ctypes.
extern "C" __attribute__((visibility("default"), used)) int64_t research_kernel_ns() {
  return research_native::kernel_ns().load(std::memory_order_relaxed);
}
