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
// Work is split over (token, kv head) pairs on the kernels' shared pool (parallel.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "parallel.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using research_native::exp_nonpositive16;
using research_native::v16;
using research_native::v16i;
using research_native::v16u;

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
  research_native::parallel_for(pool, units, 4, run);
  return ffi::Error::Success();
}


// ---- Packed attention for calls with many tokens per row (prefill chunks) ----------------
//
// Every packed token attends to its row's cached context (pages through the block table, the
// first `start` positions) and to the row's new tokens up to itself (causal), in one flash-style
// pass: keys 16 at a time, scores for 16 keys per query as one vector, a running maximum and
// sum per query, float32 throughout. Queries go in blocks of kQueryBlock tokens x G heads of one
// kv head, so each key chunk loaded (and converted) once serves all of them.
//
//   q            [N, H, E]    float32, packed tokens (each row's tokens contiguous)
//   k/v new      [N, K, E]    float32, the call's own keys and values
//   k/v pages    [K, B, P, E] float32, or bfloat16 stored as uint16 bits
//   block_tables [R, M] int32; row_start [R] (cached tokens), row_first [R] (packed index of
//   the row's first token), row_count [R] (its new tokens; 0: an empty row)
//   -> out [N, H, E] float32 (0 for tokens of no row)

constexpr int64_t kQueryBlock = 16;

constexpr int64_t kChunk = 16;  // keys per chunk (one float32 vector of scores per query)

struct PackedShapes {
  int64_t n, h, e, kvh, blocks, p, m, g, r;
};

// Keys transposed by shuffles of the target's own vector width (kW lanes: 16-lane shuffles built
// for AVX2 or SSE4 ran 2.1-2.7x slower than the scalar loop): square
// blocks of kW x kW, log2(kW) steps each; step T pairs rows r and r | (1 << T) (bit T of r
// clear) and swaps row bit T with lane bit T, so the last step leaves (row c, lane i) at (row i,
// lane c). Moves only: the same values on every target. 16 x 64 floats took 64 ns against the
// scalar loop's 310 (AVX-512), 318 (AVX2) and 405 (SSE4) on one Xeon core.
constexpr int kW = research_native::kNativeLanes;
constexpr int kTransposeSteps = kW == 16 ? 4 : kW == 8 ? 3 : 2;
typedef float vw __attribute__((vector_size(kW * 4)));
typedef float vwu __attribute__((vector_size(kW * 4), aligned(4)));

constexpr int swap_lo(int t, int l) { return (l >> t) & 1 ? kW + l - (1 << t) : l; }
constexpr int swap_hi(int t, int l) { return (l >> t) & 1 ? kW + l : l + (1 << t); }

template <int T, int... L>
inline void transpose_step(vw* r, std::integer_sequence<int, L...>) {
  for (int a = 0; a < kW; ++a) {
    if ((a >> T) & 1) continue;
    const vw x = r[a], y = r[a | (1 << T)];
    r[a] = __builtin_shufflevector(x, y, swap_lo(T, L)...);
    r[a | (1 << T)] = __builtin_shufflevector(x, y, swap_hi(T, L)...);
  }
}

template <int... T>
inline void transpose_block(vw* r, std::integer_sequence<int, T...>) {
  (transpose_step<T>(r, std::make_integer_sequence<int, kW>{}), ...);
}

// Page elements as float32: float32 as stored, bfloat16 (uint16_t bits) widened exactly.
using research_native::to_f32;
typedef uint16_t vwh __attribute__((vector_size(kW * 2), aligned(2)));
typedef uint32_t vwi __attribute__((vector_size(kW * 4)));
inline vw load_w(const float* p) { return *reinterpret_cast<const vwu*>(p); }
inline vw load_w(const uint16_t* p) {
  return reinterpret_cast<vw>(__builtin_convertvector(*reinterpret_cast<const vwh*>(p), vwi) << 16);
}
inline v16 load_16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline v16 load_16(const uint16_t* p) {
  return reinterpret_cast<v16>(
      __builtin_convertvector(*reinterpret_cast<const research_native::v16h*>(p),
                              research_native::v16ui)
      << 16);
}

// dst[i * kChunk + c] = src[c * ld + i] (as float32) for keys c < count and i < e (a multiple
// of kW); keys from count on are 0. Each key's row is read once, straight from its page.
template <typename T>
inline void transpose_keys(const T* src, int64_t ld, int64_t e, int64_t count, float* dst) {
  for (int64_t i0 = 0; i0 < e; i0 += kW) {
    for (int c0 = 0; c0 < kChunk; c0 += kW) {
      vw r[kW];
      for (int c = 0; c < kW; ++c) r[c] = c0 + c < count ? load_w(src + (c0 + c) * ld + i0) : vw{};
      transpose_block(r, std::make_integer_sequence<int, kTransposeSteps>{});
      for (int i = 0; i < kW; ++i) *reinterpret_cast<vwu*>(dst + (i0 + i) * kChunk + c0) = r[i];
    }
  }
}

// The largest and the sum of a vector's 16 lanes, halving the lanes each step (max is exact in
// any order; the sum's order is fixed: the same bits on every target).
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
inline float lanes_max(v16 x) {
  const v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 m8 = a > b ? a : b;
  const v4 c = __builtin_shufflevector(m8, m8, 0, 1, 2, 3), d = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const v4 m4 = c > d ? c : d;
  return std::max(std::max(m4[0], m4[2]), std::max(m4[1], m4[3]));
}
inline float lanes_sum(v16 x) {
  const v8 s8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Scores of Q queries (query j at q + j * e) against the transposed keys: 16 keys per vector,
// each query's dot products over k in two halves (dimensions i and e / 2 + i, then the odd last
// one) added at the end, so 2 Q independent chains of fused multiply-adds share each key load (a
// decode step's 1-4 query heads per kv head left the FMA units waiting on one chain each).
template <int Q>
inline void score_queries(const float* q, int64_t e, const v16* kt, v16* out) {
  v16 lo[Q] = {}, hi[Q] = {};
  const int64_t half = e / 2;
  for (int64_t i = 0; i < half; ++i) {
    const v16 ka = kt[i], kb = kt[half + i];
    for (int j = 0; j < Q; ++j) {
      lo[j] += q[j * e + i] * ka;
      hi[j] += q[j * e + half + i] * kb;
    }
  }
  if (e % 2) {
    for (int j = 0; j < Q; ++j) lo[j] += q[j * e + e - 1] * kt[e - 1];
  }
  for (int j = 0; j < Q; ++j) out[j] = lo[j] + hi[j];
}

// Prefetches row c of the next page's keys and values (from k_ahead and v_ahead; null: none),
// one row per key of this chunk, so the loads spread over the chunk's work instead of stalling
// in a burst (64 back to back took a tenth of a decode step's attention on a Xeon).
template <typename T>
inline void prefetch_row(const T* k_ahead, const T* v_ahead, int64_t e, int64_t c) {
  if (k_ahead == nullptr) return;
  const char* k = reinterpret_cast<const char*>(k_ahead + c * e);
  const char* v = reinterpret_cast<const char*>(v_ahead + c * e);
  for (int64_t b = 0; b < e * static_cast<int64_t>(sizeof(T)); b += 64) {
    __builtin_prefetch(k + b);
    __builtin_prefetch(v + b);
  }
}

// acc[j] += sum over keys c < count of p[j][c] * v[c] for Q queries (accumulators [Q, E] in
// registers across the keys, each V vector loaded once for all of them).
template <int HEAD_DIM, int Q, typename T>
inline void weigh_values(const float* p, const T* vbuf, int64_t count, float* acc,
                         const T* k_ahead, const T* v_ahead) {
  constexpr int kVecs = HEAD_DIM / 16;
  v16 x[Q][kVecs];
  for (int j = 0; j < Q; ++j) {
    for (int v = 0; v < kVecs; ++v) x[j][v] = reinterpret_cast<const v16u*>(acc + j * HEAD_DIM)[v];
  }
  for (int64_t c = 0; c < count; ++c) {
    prefetch_row(k_ahead, v_ahead, HEAD_DIM, c);
    v16 vt[kVecs];
    for (int v = 0; v < kVecs; ++v) vt[v] = load_16(vbuf + c * HEAD_DIM + v * 16);
    for (int j = 0; j < Q; ++j) {
      const float w = p[j * kChunk + c];
      for (int v = 0; v < kVecs; ++v) x[j][v] += w * vt[v];
    }
  }
  for (int j = 0; j < Q; ++j) {
    for (int v = 0; v < kVecs; ++v) reinterpret_cast<v16u*>(acc + j * HEAD_DIM)[v] = x[j][v];
  }
}

// Queries whose accumulators a pass of weigh_values holds in registers: 4 x 4 vectors of 16
// (HEAD_DIM 64) and the V row fit AVX-512's 32 registers; narrower targets split each into 2-4.
constexpr int kValueQueries = kW == 16 ? 4 : 2;

// Adds keys kbuf/vbuf [count <= kChunk, E] (float32, or bfloat16 bits read from the pages in
// place) to the running softmax of `nq` queries qs [nq, E]; query i sees key c when
// c < visible[i].
template <int HEAD_DIM, typename T>
void attend_chunk(const float* qs, int64_t nq, int64_t e_dyn, const T* kbuf,
                  const T* vbuf, int64_t count, const int64_t* visible, float* acc, float* mx,
                  float* sum, v16* scores, const T* k_ahead = nullptr,
                  const T* v_ahead = nullptr) {
  const int64_t e = HEAD_DIM > 0 ? HEAD_DIM : e_dyn;
  alignas(64) float kt[256 * kChunk];  // [E, kChunk]: keys transposed, zero past count
  const v16* kt_vec = reinterpret_cast<const v16*>(kt);
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  if (e % kW == 0) {
    transpose_keys(kbuf, e, e, count, kt);  // by shuffles (every head size in use)
  } else {
    for (int64_t i = 0; i < e; ++i) {
#pragma omp simd
      for (int64_t c = 0; c < kChunk; ++c) kt[i * kChunk + c] = c < count ? to_f32(kbuf[c * e + i]) : 0.0f;
    }
  }
  // Scores, four queries at a time, then the last 1-3 together.
  int64_t qi = 0;
  for (; qi + 4 <= nq; qi += 4) score_queries<4>(qs + qi * e, e, kt_vec, scores + qi);
  switch (nq - qi) {
    case 3: score_queries<3>(qs + qi * e, e, kt_vec, scores + qi); break;
    case 2: score_queries<2>(qs + qi * e, e, kt_vec, scores + qi); break;
    case 1: score_queries<1>(qs + qi * e, e, kt_vec, scores + qi); break;
    default: break;
  }
  // The running softmax of each query; scores become the chunk's weights (0 where masked).
  for (qi = 0; qi < nq; ++qi) {
    const int64_t vis = std::min<int64_t>(visible[qi], count);
    if (vis <= 0) {
      scores[qi] = v16{};
      continue;
    }
    const v16 dot = lane < static_cast<int32_t>(vis) ? scores[qi] : v16{} - INFINITY;
    const float new_max = std::max(mx[qi], lanes_max(dot));
    const float correction = std::isinf(mx[qi]) ? 0.0f : exp_nonpositive(mx[qi] - new_max);
    mx[qi] = new_max;
    const v16 p = exp_nonpositive16(dot - new_max);
    scores[qi] = p;
    sum[qi] = sum[qi] * correction + lanes_sum(p);
    if (correction != 1.0f) {
      float* a = acc + qi * e;
#pragma omp simd
      for (int64_t i = 0; i < e; ++i) a[i] *= correction;
    }
  }
  // Weighted values, kValueQueries queries at a time with their accumulators in registers.
  const int64_t keys = std::min<int64_t>(count, kChunk);
  const float* pw = reinterpret_cast<const float*>(scores);
  if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {
    for (qi = 0; qi < nq; qi += kValueQueries) {
      const float* p = pw + qi * kChunk;
      float* a = acc + qi * e;
      if (qi > 0) k_ahead = nullptr;  // the first pass has prefetched
      switch (std::min<int64_t>(kValueQueries, nq - qi)) {
        case 1: weigh_values<HEAD_DIM, 1>(p, vbuf, keys, a, k_ahead, v_ahead); break;
        case 2: weigh_values<HEAD_DIM, 2>(p, vbuf, keys, a, k_ahead, v_ahead); break;
        case 3: weigh_values<HEAD_DIM, 3>(p, vbuf, keys, a, k_ahead, v_ahead); break;
        default: weigh_values<HEAD_DIM, kValueQueries>(p, vbuf, keys, a, k_ahead, v_ahead); break;
      }
    }
  } else {
    for (int64_t c = 0; c < keys; ++c) prefetch_row(k_ahead, v_ahead, e, c);
    for (qi = 0; qi < nq; ++qi) {
      const float* p = pw + qi * kChunk;
      float* a = acc + qi * e;
      for (int64_t c = 0; c < keys; ++c) {
        const float w = p[c];
        const T* vt = vbuf + c * e;
#pragma omp simd
        for (int64_t i = 0; i < e; ++i) a[i] += w * to_f32(vt[i]);
      }
    }
  }
}

// One unit: row `row`, kv head `k`, the row's new tokens [t0, t1).
template <int HEAD_DIM>
void attend_block(const PackedShapes& s, const float* q, const float* k_new, const float* v_new,
                  const void* kp, const void* vp, bool bf16, const int32_t* tables,
                  int64_t start, int64_t first, int64_t row, int64_t k, int64_t t0, int64_t t1,
                  float scale, float* out, std::vector<float>& work) {
  const int64_t g = s.g, e = s.e, p = s.p, nq = (t1 - t0) * g;
  work.resize(2 * nq * e + 2 * nq + 2 * kChunk * e);
  thread_local std::vector<int64_t> visible;  // a thread's buffers outlive the unit
  thread_local std::vector<v16> scores;
  visible.resize(nq);
  scores.resize(nq);
  float* qs = work.data();          // [nq, E], query i = token (t0 + i / G), head k G + i % G
  float* acc = qs + nq * e;         // [nq, E]
  float* mx = acc + nq * e;         // [nq]
  float* sum = mx + nq;             // [nq]
  float* kbuf = sum + nq;           // [kChunk, E]: the call's own new keys
  float* vbuf = kbuf + kChunk * e;  // [kChunk, E]: and values
  for (int64_t t = t0; t < t1; ++t) {
    const float* qt = q + ((first + t) * s.h + k * g) * e;
    for (int64_t i = 0; i < g * e; ++i) qs[(t - t0) * g * e + i] = qt[i] * scale;
  }
  std::fill(acc, acc + nq * e, 0.0f);
  std::fill(mx, mx + nq, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + nq, 0.0f);
  // The cached context: every query sees all of it.
  std::fill(visible.begin(), visible.end(), kChunk);
  const int64_t pages = std::min<int64_t>((start + p - 1) / p, s.m);
  for (int64_t j = 0; j < pages; ++j) {
    const int64_t block = tables[row * s.m + j];
    if (block < 0 || block >= s.blocks) continue;  // never read outside the pool
    const int64_t count = std::min(p, start - j * p);
    const int64_t base = ((k * s.blocks + block) * p) * e;
    // The next page's keys and values are fetched while this one is scored (pages sit wherever
    // the block table says, so no hardware prefetcher sees the next one coming): each chunk
    // prefetches the same rows of the next page. The page's own are read in place (bfloat16
    // widened as they are loaded).
    int64_t next = j + 1 < pages ? tables[row * s.m + j + 1] : -1;
    if (next >= s.blocks) next = -1;
    auto pages_of = [&](const auto* kb, const auto* vb) {
      const int64_t ahead = ((k * s.blocks + std::max<int64_t>(next, 0)) * p) * e;
      for (int64_t c0 = 0; c0 < count; c0 += kChunk) {
        const int64_t at = base + c0 * e, n = std::min(kChunk, count - c0);
        attend_chunk<HEAD_DIM>(qs, nq, e, kb + at, vb + at, n, visible.data(), acc, mx, sum,
                               scores.data(), next < 0 ? nullptr : kb + ahead + c0 * e,
                               vb + ahead + c0 * e);
      }
    };
    if (bf16) {
      pages_of(static_cast<const uint16_t*>(kp), static_cast<const uint16_t*>(vp));
    } else {
      pages_of(static_cast<const float*>(kp), static_cast<const float*>(vp));
    }
  }
  // The row's new tokens up to each query's own (causal).
  for (int64_t c0 = 0; c0 < t1; c0 += kChunk) {
    const int64_t count = std::min(kChunk, t1 - c0);
    for (int64_t c = 0; c < count; ++c) {
      const int64_t src = ((first + c0 + c) * s.kvh + k) * e;
      std::memcpy(kbuf + c * e, k_new + src, e * sizeof(float));
      std::memcpy(vbuf + c * e, v_new + src, e * sizeof(float));
    }
    for (int64_t i = 0; i < nq; ++i) visible[i] = t0 + i / g - c0 + 1;
    attend_chunk<HEAD_DIM, float>(qs, nq, e, kbuf, vbuf, count, visible.data(), acc, mx, sum,
                                  scores.data());
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* o = out + ((first + t0 + i / g) * s.h + k * g + i % g) * e;
    const float inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
    for (int64_t d = 0; d < e; ++d) o[d] = acc[i * e + d] * inv;
  }
}

// The shapes of a packed call, checked; on success `s` and `bf16` describe it.
ffi::Error packed_shapes(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                         ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_pages,
                         ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> block_tables,
                         ffi::Buffer<ffi::S32> row_start, ffi::Buffer<ffi::S32> row_first,
                         ffi::Buffer<ffi::S32> row_count, PackedShapes* s, bool* bf16) {
  auto qd = q.dimensions();
  auto nd = k_new.dimensions();
  auto kd = k_pages.dimensions();
  auto td = block_tables.dimensions();
  const int64_t r = td.size() == 2 ? td[0] : -1;
  if (qd.size() != 3 || nd.size() != 3 || kd.size() != 4 || td.size() != 2 || nd[0] != qd[0] ||
      nd[1] != kd[0] || nd[2] != qd[2] || v_new.dimensions().size() != 3 ||
      v_new.dimensions()[0] != nd[0] || v_new.dimensions()[1] != nd[1] ||
      v_new.dimensions()[2] != nd[2] || kd[3] != qd[2] ||
      qd[1] % kd[0] != 0 || qd[2] > 256 || row_start.dimensions().size() != 1 ||
      row_start.dimensions()[0] != r || row_first.dimensions()[0] != r ||
      row_count.dimensions()[0] != r || v_pages.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v_pages.dimensions().begin())) {
    return ffi::Error::InvalidArgument("packed_attention: inconsistent shapes");
  }
  bool v_bf16 = false;
  if (!page_format(k_pages.element_type(), bf16) ||
      !page_format(v_pages.element_type(), &v_bf16) || *bf16 != v_bf16) {
    return ffi::Error::InvalidArgument("packed_attention: pages must be float32 or bfloat16");
  }
  *s = PackedShapes{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], td[1], qd[1] / kd[0], r};
  const int32_t* starts = row_start.typed_data();
  const int32_t* firsts = row_first.typed_data();
  const int32_t* counts = row_count.typed_data();
  for (int64_t i = 0; i < r; ++i) {
    if (counts[i] > 0 && (firsts[i] < 0 || firsts[i] + counts[i] > s->n || starts[i] < 0)) {
      return ffi::Error::InvalidArgument("packed_attention: a row's tokens fall outside the call");
    }
  }
  return ffi::Error::Success();
}

// The attention itself, reading the cached context from pages kp / vp.
void packed_attention(ffi::ThreadPool& pool, const PackedShapes& s, bool bf16, const float* qp,
                      const float* knp, const float* vnp, const void* kp, const void* vp,
                      const int32_t* tables, const int32_t* starts, const int32_t* firsts,
                      const int32_t* counts, float scale, float* o) {
  std::fill(o, o + s.n * s.h * s.e, 0.0f);
  // Units (row, kv head, query block), the longest rows' last blocks (the most keys) first.
  struct Unit {
    int64_t row, k, t0;
  };
  std::vector<Unit> units;
  for (int64_t i = 0; i < s.r; ++i) {
    for (int64_t t0 = 0; t0 < counts[i]; t0 += kQueryBlock) {
      for (int64_t k = 0; k < s.kvh; ++k) units.push_back({i, k, t0});
    }
  }
  std::sort(units.begin(), units.end(), [&](const Unit& a, const Unit& b) {
    return starts[a.row] + a.t0 > starts[b.row] + b.t0;
  });
  auto shared = std::make_shared<std::vector<Unit>>(std::move(units));
  auto block = s.e == 64 ? attend_block<64> : s.e == 128 ? attend_block<128> : attend_block<0>;
  auto run = [=](int64_t begin, int64_t end) {
    thread_local std::vector<float> work;
    for (int64_t u = begin; u < end; ++u) {
      const Unit& w = (*shared)[u];
      const int64_t t1 = std::min<int64_t>(counts[w.row], w.t0 + kQueryBlock);
      block(s, qp, knp, vnp, kp, vp, bf16, tables, starts[w.row], firsts[w.row], w.row,
                   w.k, w.t0, t1, scale, o, work);
    }
  };
  research_native::parallel_for(pool, static_cast<int64_t>(shared->size()), 8, run);
}

ffi::Error PackedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> row_start,
                               ffi::Buffer<ffi::S32> row_first, ffi::Buffer<ffi::S32> row_count,
                               float scale, ffi::ResultBuffer<ffi::F32> out) {
  PackedShapes s;
  bool bf16 = false;
  ffi::Error checked = packed_shapes(q, k_new, v_new, k_pages, v_pages, block_tables, row_start,
                                     row_first, row_count, &s, &bf16);
  if (checked.failure()) return checked;
  packed_attention(pool, s, bf16, q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                   k_pages.untyped_data(), v_pages.untyped_data(), block_tables.typed_data(),
                   row_start.typed_data(), row_first.typed_data(), row_count.typed_data(), scale,
                   out->typed_data());
  return ffi::Error::Success();
}

// float32 -> the pages' element: bfloat16 bits rounded to nearest even (NaN stays NaN), as
// XLA's convert.
inline uint16_t page_bf16(float f) {
  if (f != f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  return research_native::to_bf16(f);
}

// The same attention, after storing the call's new K/V in the pages (write_kv's scatter, done
// here so that a step needs no second call): k_out / v_out alias k_pages / v_pages (the caller
// donates them), and each row's t-th new token goes to position row_start + t of its block
// table; positions past the table, or blocks outside the pool, are dropped as write_kv drops
// them. The context read is positions < row_start only, so the order of the two does not
// matter; the stores come first.
ffi::Error PackedAttentionWriteImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
    ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> row_start,
    ffi::Buffer<ffi::S32> row_first, ffi::Buffer<ffi::S32> row_count, float scale,
    ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
    ffi::Result<ffi::AnyBuffer> v_out) {
  PackedShapes s;
  bool bf16 = false;
  ffi::Error checked = packed_shapes(q, k_new, v_new, k_pages, v_pages, block_tables, row_start,
                                     row_first, row_count, &s, &bf16);
  if (checked.failure()) return checked;
  auto kd = k_pages.dimensions();
  if (k_out->element_type() != k_pages.element_type() ||
      v_out->element_type() != v_pages.element_type() ||
      k_out->size_bytes() != k_pages.size_bytes() || v_out->size_bytes() != v_pages.size_bytes() ||
      !std::equal(kd.begin(), kd.end(), k_out->dimensions().begin())) {
    return ffi::Error::InvalidArgument("packed_attention: written pages differ from the pages");
  }
  void* kp = k_out->untyped_data();
  void* vp = v_out->untyped_data();
  // XLA gives the donated operand's own buffer; a copy where it did not keeps the call right.
  if (kp != k_pages.untyped_data()) std::memcpy(kp, k_pages.untyped_data(), k_pages.size_bytes());
  if (vp != v_pages.untyped_data()) std::memcpy(vp, v_pages.untyped_data(), v_pages.size_bytes());
  const int32_t* tables = block_tables.typed_data();
  const int32_t* starts = row_start.typed_data();
  const int32_t* firsts = row_first.typed_data();
  const int32_t* counts = row_count.typed_data();
  const float* knp = k_new.typed_data();
  const float* vnp = v_new.typed_data();
  for (int64_t i = 0; i < s.r; ++i) {
    for (int64_t t = 0; t < counts[i]; ++t) {
      const int64_t pos = starts[i] + t, page = pos / s.p;
      if (page >= s.m) continue;
      const int64_t blk = tables[i * s.m + page];
      if (blk < 0 || blk >= s.blocks) continue;
      const int64_t token = firsts[i] + t;
      for (int64_t k = 0; k < s.kvh; ++k) {
        const int64_t dst = ((k * s.blocks + blk) * s.p + pos % s.p) * s.e;
        const float* ks = knp + (token * s.kvh + k) * s.e;
        const float* vs = vnp + (token * s.kvh + k) * s.e;
        if (bf16) {
          uint16_t* kw = static_cast<uint16_t*>(kp) + dst;
          uint16_t* vw = static_cast<uint16_t*>(vp) + dst;
          for (int64_t d = 0; d < s.e; ++d) kw[d] = page_bf16(ks[d]), vw[d] = page_bf16(vs[d]);
        } else {
          std::memcpy(static_cast<float*>(kp) + dst, ks, s.e * sizeof(float));
          std::memcpy(static_cast<float*>(vp) + dst, vs, s.e * sizeof(float));
        }
      }
    }
  }
  packed_attention(pool, s, bf16, q.typed_data(), knp, vnp, kp, vp, tables, starts, firsts, counts,
                   scale, out->typed_data());
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

// The packed call's operands, attribute and attention output (both handlers).
static auto packed_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Attr<float>("scale")
      .Ret<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedAttention, PackedAttentionImpl, packed_binding());

// ... and the written pages, aliasing the operands k_pages / v_pages.
XLA_FFI_DEFINE_HANDLER_SYMBOL(PackedAttentionWrite, PackedAttentionWriteImpl,
                              packed_binding().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
