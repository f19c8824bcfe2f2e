// Paged attention over the KV pool's pages for CPU, called from XLA through its FFI.
//
// One query token attends to the first `length` cached tokens of its sequence, read in place
// through its block table: no gathered copy of the context, each K/V byte read once. Scores,
// softmax and the weighted sum run in float32, one page at a time with a running maximum
// (flash-style), so a row costs what its own context costs, whatever the call's other rows hold.
//
//   q            [N, H, E]    float32     (query heads h = kv_head * G + g)
//   k/v pages    [K, B, P, E] float32, or bfloat16 stored as uint16 bits
//   block_tables [N, M]       int32       (only the first ceil(length / P) entries are read)
//   lengths      [N]          int32
//   -> out [N, H, E] float32 (0 where length is 0), lse [N, H] float32 (-inf there)
//
// Work is split over (token, kv head) pairs on XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Converts `count` contiguous page elements to float32.
inline void load(const void* pages, bool bf16, int64_t offset, int64_t count, float* dst) {
  if (bf16) {
    const uint16_t* src = static_cast<const uint16_t*>(pages) + offset;
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) {
      uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&dst[i], &bits, sizeof(float));
    }
  } else {
    std::memcpy(dst, static_cast<const float*>(pages) + offset, count * sizeof(float));
  }
}

// exp(x) for x <= 0 in a form the compiler vectorizes (Cephes' expf: x = n ln2 + r, a degree-6
// polynomial for exp(r), 2^n by the exponent bits); within 2 ulp of std::exp, and 0 below -87.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return x < -87.0f ? 0.0f : y * scale;
}

struct Shapes {
  int64_t n, h, e, kvh, blocks, p, m, g;
};

// Attention of token `n` over kv head `k`'s G query heads; HEAD_DIM > 0 fixes E at compile time
// (the inner loops unroll into registers), 0 reads it from `s`. Per page: K and V converted to
// float32 once (contiguous [count, E] runs), then scores, the running softmax and the weighted
// sum for each query head with its accumulator held across the page's tokens.
template <int HEAD_DIM>
void attend(const Shapes& s, const float* q, const void* kp, const void* vp, bool bf16,
            const int32_t* tables, const int32_t* lengths, float scale, int64_t n, int64_t k,
            float* out, float* lse, std::vector<float>& work) {
  const int64_t g = s.g, e = HEAD_DIM > 0 ? HEAD_DIM : s.e, p = s.p;
  work.resize(2 * g * e + 2 * g + g * p + 2 * p * e);
  float* acc = work.data();      // [G, E]
  float* qs = acc + g * e;       // [G, E]: q * scale
  float* mx = qs + g * e;        // [G]
  float* sum = mx + g;           // [G]
  float* scores = sum + g;       // [G, P]
  float* kbuf = scores + g * p;  // [P, E]
  float* vbuf = kbuf + p * e;    // [P, E]
  std::fill(acc, acc + g * e, 0.0f);
  std::fill(mx, mx + g, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + g, 0.0f);
  const float* qk = q + (n * s.h + k * g) * e;
  for (int64_t i = 0; i < g * e; ++i) qs[i] = qk[i] * scale;
  const int64_t length = std::max<int32_t>(0, lengths[n]);
  const int64_t pages = std::min<int64_t>((length + p - 1) / p, s.m);
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t block = tables[n * s.m + j];
    if (block < 0 || block >= s.blocks) continue;  // never read outside the pool
    const int64_t count = std::min(p, length - j * p);
    const int64_t base = ((k * s.blocks + block) * p) * e;
    if (j + 1 < pages) {  // pages are scattered: fetch the next one while this one computes
      const int64_t next = tables[n * s.m + j + 1];
      if (next >= 0 && next < s.blocks) {
        const int64_t width = bf16 ? 2 : 4, bytes = p * e * width;
        const int64_t offset = ((k * s.blocks + next) * p) * e * width;
        const char* kn = static_cast<const char*>(kp) + offset;
        const char* vn = static_cast<const char*>(vp) + offset;
        for (int64_t b = 0; b < bytes; b += 64) {
          __builtin_prefetch(kn + b);
          __builtin_prefetch(vn + b);
        }
      }
    }
    load(kp, bf16, base, count * e, kbuf);
    load(vp, bf16, base, count * e, vbuf);
    for (int64_t gi = 0; gi < g; ++gi) {
      const float* qg = qs + gi * e;
      float* sg = scores + gi * p;
      float page_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < count; ++t) {
        const float* kt = kbuf + t * e;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < e; ++i) dot += qg[i] * kt[i];
        sg[t] = dot;
        page_max = std::max(page_max, dot);
      }
      const float new_max = std::max(mx[gi], page_max);
      const float correction = std::isinf(mx[gi]) ? 0.0f : std::exp(mx[gi] - new_max);
      mx[gi] = new_max;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < count; ++t) {
        sg[t] = exp_nonpositive(sg[t] - new_max);
        total += sg[t];
      }
      total += sum[gi] * correction;
      sum[gi] = total;
      float* a = acc + gi * e;
      if (correction != 1.0f) {
#pragma omp simd
        for (int64_t i = 0; i < e; ++i) a[i] *= correction;
      }
      for (int64_t t = 0; t < count; ++t) {
        const float w = sg[t];
        const float* vt = vbuf + t * e;
#pragma omp simd
        for (int64_t i = 0; i < e; ++i) a[i] += w * vt[i];
      }
    }
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    const int64_t head = n * s.h + k * g + gi;
    float* o = out + head * e;
    if (sum[gi] > 0.0f) {
      const float inv = 1.0f / sum[gi];
      for (int64_t i = 0; i < e; ++i) o[i] = acc[gi * e + i] * inv;
      lse[head] = mx[gi] + std::log(sum[gi]);
    } else {
      std::fill(o, o + e, 0.0f);
      lse[head] = -std::numeric_limits<float>::infinity();
    }
  }
}

bool page_format(ffi::DataType t, bool* bf16) {
  if (t == ffi::DataType::F32) {
    *bf16 = false;
    return true;
  }
  if (t == ffi::DataType::BF16 || t == ffi::DataType::U16) {
    *bf16 = true;
    return true;
  }
  return false;
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                              ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> lengths, float scale,
                              ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || td[0] != qd[0] ||
      lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0] ||
      kd[3] != qd[2] || qd[1] % kd[0] != 0) {
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  }
  bool bf16 = false, v_bf16 = false;
  if (!page_format(k_pages.element_type(), &bf16) ||
      !page_format(v_pages.element_type(), &v_bf16) || bf16 != v_bf16) {
    return ffi::Error::InvalidArgument("paged_attention: pages must be float32 or bfloat16");
  }
  Shapes s{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1], qd[1] / kd[0]};
  const int64_t units = s.n * s.kvh;
  const float* qp = q.typed_data();
  const void* kp = k_pages.untyped_data();
  const void* vp = v_pages.untyped_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t* lens = lengths.typed_data();
  float* o = out->typed_data();
  float* l = lse->typed_data();

  auto one = s.e == 64 ? attend<64> : s.e == 128 ? attend<128> : attend<0>;
  auto run = [=](int64_t begin, int64_t end) {
    std::vector<float> work;
    for (int64_t u = begin; u < end; ++u) {
      one(s, qp, kp, vp, bf16, tables, lens, scale, u / s.kvh, u % s.kvh, o, l, work);
    }
  };
  const int64_t helpers = std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), units - 1));
  if (helpers == 0) {
    run(0, units);
    return ffi::Error::Success();
  }
  // Chunks claimed from a shared counter by this thread and the pool's: this thread never
  // waits on a chunk nobody has claimed, and a task that starts late finds none left (the state
  // it touches is shared, so it outlives this call).
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  const int64_t chunks = std::min<int64_t>(units, 4 * (helpers + 1));
  auto worker = [state, run, chunks, units] {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      run(units * c / chunks, units * (c + 1) / chunks);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(worker)(worker));
  worker();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
