// A model's projections on CPU, called from XLA through its FFI: three kernels in one source.
//
//   - AMX (this top part): bfloat16 on Intel's tile units, where the CPU has them;
//   - the vector kernel (below): bfloat16 and float32 on whatever vector unit the compiler
//     targets (AVX2, AVX-512, NEON), the path of every CPU without AMX;
//   - GGUF blocks (below): Q4_1 and Q8_0 weights read as the file stores them.
//
// All three share the panel idea (each 32 output columns one contiguous weight stream) and the
// epilogues (float32 or bfloat16 output; silu(gate) * up for a fused gate/up weight).
//
// AMX. Inside a step, where XLA:CPU fuses each bfloat16 dot with its neighbours (the cast to the
// model's dtype, an activation), its dots ran at 0.2-0.5 TFLOP/s on a core pair whose AMX units
// give 2-2.5 to this kernel and to oneDNN through torch (experiments/bench_gemm.py measures
// them side by side). This kernel feeds the tile units directly:
//
//   x [M, K]             bfloat16, row-major (read in place: an A tile is 16 rows x 32 k)
//   w [N/32, K/32, 16, 2, 32] bfloat16, the weight W [K, N] packed once at load time, each
//                        32-column panel one contiguous stream:
//                        w[g, kb, r, t, 2c + j] = W[32 kb + 2 r + j, 32 g + 16 t + c];
//                        AMX's B tile for half t of k block kb is its 16 rows r, 64 bytes
//                        each at a 128-byte stride (a k pair's 32 columns are consecutive, so
//                        the vector kernel reads each panel front to back)
//   -> y [M, N] float32 or bfloat16 (products accumulated in float32 by the tile unit); with
//      the swiglu epilogue, y [M, N / 2] = silu(gate) * up for a gate/up weight packed with
//      each 32-column panel holding 16 gate columns and then the same 16 up columns
//
// Each output element is one dot product over k in a fixed order (32 at a time, k ascending),
// whatever M is and wherever the row sits in x: rows are batch-invariant.
//
// Work: units of (up to 128 rows, 32 columns); consecutive units share their rows (x stays in
// cache) and walk the columns (each weight panel streams once per 128 rows), claimed over the
// cores (parallel.h). Rows go 32 at a time (2 x 2 tiles: each tile load feeds two products), the
// tail 16 at a time.

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RESEARCH_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__))
#include <immintrin.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#endif
#if defined(__unix__)
#include <unistd.h>  // sysconf: the L1D size (step_blocks)
#endif

#include "parallel.h"
#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Where a panel's products go: y [m, n] (epilogue none) or, for a gate/up weight whose panels
// hold 16 gate columns then the same 16 up columns, y [m, n / 2] = silu(gate) * up; float32 or
// bfloat16 (rounded to nearest even).
struct Output {
  void* y;
  bool bf16;
  bool swiglu;
  int64_t cols;  // y's row length

  // scratch [rows, 32] float32: panel g's products for rows m0 .. m0 + rows.
  void write(const float* scratch, int rows, int64_t m0, int64_t g) const {
    using research_native::v16;
    using research_native::v16u;
    for (int r = 0; r < rows; ++r) {
      const float* c = scratch + r * 32;
      if (swiglu) {
        const v16 gate = *reinterpret_cast<const v16*>(c);
        const v16 up = *reinterpret_cast<const v16*>(c + 16);
        store(research_native::silu16(gate) * up, (m0 + r) * cols + g * 16);
      } else {
        store(*reinterpret_cast<const v16*>(c), (m0 + r) * cols + g * 32);
        store(*reinterpret_cast<const v16*>(c + 16), (m0 + r) * cols + g * 32 + 16);
      }
    }
  }

  void store(research_native::v16 v, int64_t offset) const {
    if (bf16) {
      auto* dst = reinterpret_cast<research_native::v16h*>(static_cast<uint16_t*>(y) + offset);
      *dst = research_native::to_bf16x16(v);
    } else {
      *reinterpret_cast<research_native::v16u*>(static_cast<float*>(y) + offset) = v;
    }
  }
};

#ifdef RESEARCH_AMX

constexpr int64_t kRowsPerUnit = 128;
constexpr int64_t kPrefetchAhead = 4;  // k blocks (2 KB each) of the weight stream ahead

// The CPU has AMX-TILE and AMX-BF16 and the kernel granted this process the tile state.
bool amx_ready() {
  static const bool ready = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 x 16 float32), 4-5: A (16 x 32 bf16), 6-7: B (16 x 16 pairs of bf16). A
// tail of mr < 32 rows uses C 0-1 and A 4 with mr rows (mr = 0: the full 32-row layout).
void configure(int mr) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  if (mr > 0) cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = mr;
  _tile_loadconfig(&cfg);
}

inline void prefetch(const uint16_t* b) {
  const char* p = reinterpret_cast<const char*>(b);
  for (int i = 0; i < 2048; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// c[0:rows, 0:32] = x[0:rows, :] @ W[:, 32 columns], rows 32 (kPair: 2 x 2 tiles, each tile
// load feeding two products) or the configured tail of mr < 32 rows taken 16 at a time; b is
// the column pair's stream of k blocks (2 tiles of 16 x 32 each, 2 KB); c is a [32, 32] float32
// scratch.
template <bool kPair>
void block(const uint16_t* a, int64_t lda_bytes, const uint16_t* b, int64_t kbs, float* c,
           bool stream) {
  constexpr int64_t ldc_bytes = 32 * 4;
  const uint16_t* a1 = a + 16 * lda_bytes / 2;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kPair) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (stream) prefetch(b + (kb + kPrefetchAhead) * 1024);
    _tile_loadd(4, a + kb * 32, lda_bytes);
    _tile_loadd(6, b + kb * 1024, 128);
    _tile_loadd(7, b + kb * 1024 + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kPair) {
      _tile_loadd(5, a1 + kb * 32, lda_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, ldc_bytes);
  _tile_stored(1, c + 16, ldc_bytes);
  if constexpr (kPair) {
    _tile_stored(2, c + 16 * 32, ldc_bytes);
    _tile_stored(3, c + 16 * 32 + 16, ldc_bytes);
  }
}

// y [m, n] = x [m, k] @ W, W packed (see the top of this file); each 32-column panel's float32
// products land in a scratch block and the epilogue writes them out.
void gemm(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, const uint16_t* xp,
          const uint16_t* wp, const Output& out) {
  const int64_t groups = n / 32, kbs = k / 32;
  const int64_t row_units = (m + kRowsPerUnit - 1) / kRowsPerUnit;
  auto run = [=](int64_t begin, int64_t end) {
    alignas(64) float scratch[32 * 32];
    int configured = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % groups;
      const uint16_t* b = wp + g * kbs * 1024;
      const int64_t m_end = std::min(m, (u / groups + 1) * kRowsPerUnit);
      const int64_t m_begin = (u / groups) * kRowsPerUnit;
      int64_t m0 = m_begin;
      // The first pass over a panel streams it from memory: prefetch ahead of the loads.
      for (; m0 + 32 <= m_end; m0 += 32) {
        if (configured != 0) configure(configured = 0);
        block<true>(xp + m0 * k, k * 2, b, kbs, scratch, m0 == m_begin);
        out.write(scratch, 32, m0, g);
      }
      for (; m0 < m_end; m0 += 16) {
        const int mr = static_cast<int>(std::min<int64_t>(16, m_end - m0));
        if (configured != mr) configure(configured = mr);
        block<false>(xp + m0 * k, k * 2, b, kbs, scratch, m0 == m_begin);
        out.write(scratch, mr, m0, g);
      }
    }
    if (configured >= 0) _tile_release();
  };
  research_native::parallel_for(pool, row_units * groups, 4, run);
}

#else  // no AMX in this build: ``kernel`` never resolves to it (ResearchAmxReady() is 0)

bool amx_ready() { return false; }
void gemm(ffi::ThreadPool&, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*,
          const Output&) {}

#endif

// ---- The vector kernel: any CPU, whatever vector width the compiler targets ----------------
//
// Decode multiplies a few rows by every weight once, so a step is as fast as the weights
// stream: each 32-column panel (a contiguous stream, read front to back) is read once per
// unit of up to kVecUnitRows rows, in steps of kStepBlocks k blocks that every block of
// kVecRows rows (float32: kF32Rows) takes from cache in turn, each output column one float32
// lane. A unit's rows are widened to float32 once. A bfloat16 pair (two k) is one
// 32-bit lane: the even k is its low half (<< 16), the odd k its high half (& 0xFFFF0000),
// both exact in float32, so a product of two bf16 values is exact too. Each lane keeps two
// float32 sums, of its even-k and of its odd-k products, each in k order through fused
// multiply-adds (two independent chains, so the FMA units never wait on one), and adds them at
// the end: the same bits on every instruction set (AVX-512, AVX2 and SSE are tested; NEON by
// the same arithmetic) and for any number of rows, so a row's result never depends on its
// batch. (AVX512-BF16's vdpbf16ps ran at half the speed of two FMAs on an AVX512-BF16 Xeon, and
// it and AMX each round differently from this kernel: this kernel uses neither.) float32
// weights are panels [K, 32], summed the same way.

// Vectors of the target's native width (a wider GCC vector would be split into registers
// the compiler spills); a pass covers kPassCols of a panel's 32 columns for kVecRows rows, its
// 2 x kVecRows x kPassCols / kLanes accumulators and the pass's weights in registers.
constexpr int kLanes = research_native::kNativeLanes;
#if defined(__AVX512F__)
constexpr int kVecRows = 4, kPassCols = 32;  // 16 accumulators of 32 registers
#elif defined(__AVX__)
constexpr int kVecRows = 2, kPassCols = 16;  // 8 accumulators of 16 registers
#else  // NEON, SSE: 128-bit vectors (32 registers on NEON, 16 on SSE)
constexpr int kVecRows = 2, kPassCols = 16;
#endif
constexpr int kPassVecs = kPassCols / kLanes;
// float32 weights need no widening, so an AVX-512 pass holds 6 rows (24 accumulators; the
// compiler takes each weight vector as the multiply-add's memory operand). Against 4 rows on a
// Zen 4 core pair (warm products of SmolLM2's shapes, best of 200 calls, builds alternating
// three times): 64 rows 144-164 -> 189-202 GFLOP/s (one run 105 at 576 x 576), 32 rows 133-158
// -> 189-195, 8 rows 134-148 -> 165-178. Holding the weights in registers (an empty asm) took 6
// rows to 166-178 only.
#if defined(__AVX512F__)
constexpr int kF32Rows = 6;
#else
constexpr int kF32Rows = kVecRows;
#endif
template <typename T>
constexpr int kRowsOf = std::is_same_v<T, float> ? kF32Rows : kVecRows;
constexpr int64_t kVecUnitRows = 64;

typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef float vfu __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuu __attribute__((vector_size(kLanes * 4), aligned(4)));

// The even-k and odd-k weights of kLanes columns from `col` at k pair (kb, r).
inline void load_pair(const uint16_t* panel, int64_t kb, int r, int col, vf& e, vf& o) {
  const uint16_t* p = panel + kb * 1024 + r * 64 + (col / 16) * 32 + (col % 16) * 2;
  const vu w = *reinterpret_cast<const vuu*>(p);
  e = reinterpret_cast<vf>(w << 16);
  o = reinterpret_cast<vf>(w & 0xFFFF0000u);
}

inline void load_pair(const float* panel, int64_t kb, int r, int col, vf& e, vf& o) {
  const float* p = panel + (kb * 32 + 2 * r) * 32 + col;
  e = *reinterpret_cast<const vfu*>(p);
  o = *reinterpret_cast<const vfu*>(p + 32);
}

// Prefetch the weights kPrefetchBytes ahead of the k pair (kb, r) being read: the panel
// streams from memory once per unit, and the hardware prefetcher alone left a decode-sized
// product at 60% of the read rate a plain sum loop reaches on the same cores (past a panel's
// end the next panel follows in memory). A decode step's bf16 projections (30 layers of
// SmolLM2, 2 cores of an Emerald Rapids Xeon) read at 0.79 of a plain two-thread C product
// over the same buffers in the same process with 24 KB, 0.84 with 12 KB (8 and 16 KB no
// better; one thread alone: 4-12 KB at a plain sum's rate, 24 KB 0.95 of it).
constexpr int64_t kPrefetchBytes = 12288;

inline void prefetch_pair(const uint16_t* panel, int64_t kb, int r) {
  const char* p = reinterpret_cast<const char*>(panel + kb * 1024 + r * 64) + kPrefetchBytes;
  __builtin_prefetch(p);
  __builtin_prefetch(p + 64);
}

inline void prefetch_pair(const float* panel, int64_t kb, int r) {
  const char* p = reinterpret_cast<const char*>(panel + (kb * 32 + 2 * r) * 32) + kPrefetchBytes;
  for (int line = 0; line < 256; line += 64) __builtin_prefetch(p + line);
}

// What a pass over a panel prefetches: `stream`, the panel itself kPrefetchBytes ahead of its
// loads (the pass that reads it from memory); `next`, a share of the next panel of the unit's
// thread, spread over the pass (k pair t of the pass takes the line at byte
// ((t0 + t) * step256) >> 8, toward L2: prefetcht1): where every row block makes one whole
// pass over a panel, the passes after the first read it from L2 and left the memory idle. On
// Zen 4 (bf16 chains of a step's projections, old and new builds alternating twice): 8 rows
// 13.8 / 12.9 -> 11.4 / 10.8 ms, 16 rows 17.4 / 18.5 -> 17.5 / 15.5, 32 rows 27.8 / 32.3 ->
// 28.2 / 30.7 (the arithmetic bounds it there); with prefetcht0 the next panel went through
// the 32 KB L1 and evicted the rows and sums: 8 rows took 20.7 ms.
struct Ahead {
  bool stream = false;
  const char* next = nullptr;
  int64_t t0 = 0, step256 = 0;
};

inline void prefetch_next(const Ahead& a, int64_t t) {
  const int64_t at = (a.t0 + t) * a.step256 >> 8, before = (a.t0 + t - 1) * a.step256 >> 8;
  if (t == 0 || (at >> 6) != (before >> 6)) __builtin_prefetch(a.next + at, 0, 2);
}

// Adds, for rows i < R, the products of k pairs in blocks kb0 .. kb1 (16 pairs each) to the
// running sums in acc (row i: 32 even-k sums, then 32 odd-k sums, at acc + i * 64), for the
// kPassCols columns from c0; x: float32 rows, row i at x + i * ldx. The sums stay float32
// between calls, so a sum is the same chain of fused multiply-adds however k is cut.
template <int R, typename T>
void vec_rows(const T* panel, const float* x, int64_t ldx, int64_t kb0, int64_t kb1, int c0,
              float* acc, const Ahead& ahead) {
  vf even[R][kPassVecs], odd[R][kPassVecs];
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < kPassVecs; ++v) {
      even[i][v] = *reinterpret_cast<const vf*>(acc + i * 64 + c0 + v * kLanes);
      odd[i][v] = *reinterpret_cast<const vf*>(acc + i * 64 + 32 + c0 + v * kLanes);
    }
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const float* xk = x + kb * 32;
    for (int r = 0; r < 16; ++r) {
      vf e[kPassVecs], o[kPassVecs];
      if (ahead.stream) prefetch_pair(panel, kb, r);
      if (ahead.next != nullptr) prefetch_next(ahead, (kb - kb0) * 16 + r);
      for (int v = 0; v < kPassVecs; ++v) load_pair(panel, kb, r, c0 + v * kLanes, e[v], o[v]);
      for (int i = 0; i < R; ++i) {
        const float xe = xk[i * ldx + 2 * r], xo = xk[i * ldx + 2 * r + 1];
        for (int v = 0; v < kPassVecs; ++v) {
          even[i][v] += xe * e[v];
          odd[i][v] += xo * o[v];
        }
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < kPassVecs; ++v) {
      *reinterpret_cast<vf*>(acc + i * 64 + c0 + v * kLanes) = even[i][v];
      *reinterpret_cast<vf*>(acc + i * 64 + 32 + c0 + v * kLanes) = odd[i][v];
    }
  }
}

// k blocks per step of a unit: every row block of the unit takes its products over one step
// of the panel before the next step is read, so the panel streams from memory once, each
// piece used by all the unit's rows while it is in cache (with one full pass per row block,
// the passes after the first left the memory bus idle). Against that, on 2 cores of an
// AVX-512 Xeon, alternating processes (``bench_gemm --chain --dtype float32``): 8 rows 0.64 ->
// 0.67 of a read, 32 rows 0.29 -> 0.34 (medians of 3); steps of 1 block were slower. A Zen 4
// core (32 KB L1D against the Xeon's 48) measured the other way: one whole pass per row block
// (the later passes reading the panel from L2) against steps of 4, alternating builds in one
// window (``bench_gemm --chain``, medians of 5): float32 8 rows 29.3 -> 25.5 ms, 32 rows 68.8
// -> 60.7, 64 rows 133 -> 119; bfloat16 32 rows 50.4 -> 46.7, 64 rows 97.4 -> 92.5. Why is
// not established (a step's weights, accumulators and rows exceed either L1 at 64 rows), so
// each CPU keeps what was measured faster on it: steps where the L1D is 48 KB or more, or
// unknown; whole passes where it is smaller.
constexpr int64_t kStepBlocks = 4;

inline int64_t step_blocks(int64_t kbs) {
  static const bool whole = [] {
#if defined(_SC_LEVEL1_DCACHE_SIZE)
    const long l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return l1 > 0 && l1 < 48 * 1024;
#else
    return false;
#endif
  }();
  return whole ? kbs : kStepBlocks;
}

template <int R, typename T>
void vec_rows_step(const T* panel, const float* x, int64_t ldx, int64_t kb0, int64_t kb1,
                   float* acc, const Ahead& ahead) {
  for (int c0 = 0; c0 < 32; c0 += kPassCols) {
    vec_rows<R>(panel, x, ldx, kb0, kb1, c0, acc, c0 == 0 ? ahead : Ahead{});
  }
}

// AVX512-BF16's vdpbf16ps, where the build has it and the CPU is AMD's: on a Zen 4 core it
// multiplied 4 rows by a cached bf16 panel at 117 GMAC/s against 55 for the two-FMA arithmetic
// above (one core, the same loop otherwise), while on an AVX512-BF16 Xeon it ran at half the
// speed of the two FMAs; so Intel's CPUs keep them. Its arithmetic is the instruction's own:
// per lane and k pair, acc += x_odd w_odd, then acc += x_even w_even, each a float32 fused
// multiply-add (the products are exact); Intel's definition also reads denormal inputs as
// zero and flushes results to zero (a Zen 4 matched the order bit for bit in the kernel tests,
// on normal values; its denormal handling was not tested). One sum per output, in the even-k slots of
// acc (the odd-k slots stay 0, so the epilogue's even + odd is that sum); rows stay batch-
// invariant. x: the rows' bfloat16 k pairs as 32-bit words, row i at x + i * ldx.
#if defined(__x86_64__) && defined(__AVX512BF16__)
#define RESEARCH_BF16_DOT 1
bool bf16_dot() {
  static const bool use = [] {
    const char* env = std::getenv("RESEARCH_GEMM_BF16_DOT");  // "0": the two FMAs anyway
    if (env != nullptr && std::string(env) == "0") return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && d == 0x69746e65u &&
           c == 0x444d4163u;  // "AuthenticAMD"
  }();
  return use;
}

template <int R>
void dot_rows(const uint16_t* panel, const uint32_t* x, int64_t ldx, int64_t kb0, int64_t kb1,
              float* acc, const Ahead& ahead) {
  __m512 s[R][2];
  for (int i = 0; i < R; ++i) {
    s[i][0] = _mm512_load_ps(acc + i * 64);
    s[i][1] = _mm512_load_ps(acc + i * 64 + 16);
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    for (int r = 0; r < 16; ++r) {
      if (ahead.stream) prefetch_pair(panel, kb, r);
      if (ahead.next != nullptr) prefetch_next(ahead, (kb - kb0) * 16 + r);
      const uint16_t* p = panel + kb * 1024 + r * 64;
      const __m512bh a = (__m512bh)_mm512_loadu_si512(p);
      const __m512bh b = (__m512bh)_mm512_loadu_si512(p + 32);
      for (int i = 0; i < R; ++i) {
        const __m512bh xi = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + kb * 16 + r]));
        s[i][0] = _mm512_dpbf16_ps(s[i][0], xi, a);
        s[i][1] = _mm512_dpbf16_ps(s[i][1], xi, b);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm512_store_ps(acc + i * 64, s[i][0]);
    _mm512_store_ps(acc + i * 64 + 16, s[i][1]);
  }
}
#else
bool bf16_dot() { return false; }
#endif

// fn(std::integral_constant<int, R>) for a row block of n rows (1 .. Max, n >= Max: Max): the
// kernels' row count is a template parameter.
template <int Max, typename Fn>
void with_rows(int64_t n, Fn&& fn) {
  if constexpr (Max > 1) {
    if (n < Max) return with_rows<Max - 1>(n, fn);
  }
  fn(std::integral_constant<int, Max>{});
}

// y = x @ W through the vector kernel: units of (up to kVecUnitRows rows, one panel), units
// that share rows consecutive, claimed over the cores. T: uint16_t (bf16 bits) or float, for
// both x and W.
template <typename T>
void vec_gemm(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, const T* xp, const T* wp,
              const Output& out) {
  constexpr int kRows = kRowsOf<T>;
  const int64_t groups = n / 32, panel_elems = k * 32, kbs = k / 32;
  const int64_t row_units = (m + kVecUnitRows - 1) / kVecUnitRows;
  const bool dot = !std::is_same_v<T, float> && bf16_dot();
  auto run = [=](int64_t begin, int64_t end) {
    alignas(64) float acc[kVecUnitRows * 64];      // per row: even-k sums, odd-k sums
    alignas(64) float scratch[kVecUnitRows * 32];  // per row: even + odd
    // The current row unit in float32 (bfloat16 rows); a thread's buffer outlives the call
    // (a step makes ~1000 of these calls, each a malloc and free of up to 1536 floats before).
    thread_local std::vector<float> widened;
    int64_t have = -1;  // which row unit `widened` holds
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % groups, unit = u / groups;
      const T* panel = wp + g * panel_elems;
      const int64_t m_begin = unit * kVecUnitRows;
      const int64_t m_end = std::min(m, m_begin + kVecUnitRows);
      const int64_t rows = m_end - m_begin;
      const float* x;
      if constexpr (std::is_same_v<T, float>) {
        x = xp + m_begin * k;
      } else if (dot) {
        x = nullptr;  // dot_rows reads the bfloat16 rows in place
      } else {
        if (have != unit) {
          const int64_t count = rows * k;
          widened.resize(count);
          float* dst = widened.data();
          const uint16_t* src = xp + m_begin * k;
          for (int64_t i = 0; i < count; ++i) dst[i] = research_native::to_f32(src[i]);
          have = unit;
        }
        x = widened.data();
      }
      std::fill(acc, acc + rows * 64, 0.0f);
      const int64_t step = rows <= kRows ? kbs : step_blocks(kbs);  // one row block: one pass
      const int64_t row_blocks = (rows + kRows - 1) / kRows;
      const bool share_next = step == kbs && row_blocks > 1 && u + 1 < end && (u + 1) / groups == unit;
      for (int64_t kb0 = 0; kb0 < kbs; kb0 += step) {
        const int64_t kb1 = std::min(kbs, kb0 + step);
        for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
          float* a = acc + i0 * 64;
          Ahead ahead;
          ahead.stream = i0 == 0;  // the row block that reads the panel from memory
          if (share_next) {  // whole passes: each takes its share of the next panel
            ahead.next = reinterpret_cast<const char*>(wp + ((u + 1) % groups) * panel_elems);
            ahead.t0 = i0 / kRows * 16 * kbs;
            ahead.step256 = 64 * static_cast<int64_t>(sizeof(T)) * 256 / row_blocks;
          }
          with_rows<kRows>(std::min<int64_t>(kRows, rows - i0), [&](auto r) {
            constexpr int R = decltype(r)::value;
#ifdef RESEARCH_BF16_DOT
            if constexpr (!std::is_same_v<T, float>) {
              if (dot) {
                const auto* xr = reinterpret_cast<const uint32_t*>(xp + (m_begin + i0) * k);
                dot_rows<R>(panel, xr, k / 2, kb0, kb1, a, ahead);
                return;
              }
            }
#endif
            vec_rows_step<R>(panel, x + i0 * k, k, kb0, kb1, a, ahead);
          });
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int c = 0; c < 32; c += kLanes) {
          *reinterpret_cast<vf*>(scratch + i * 32 + c) =
              *reinterpret_cast<const vf*>(acc + i * 64 + c) +
              *reinterpret_cast<const vf*>(acc + i * 64 + 32 + c);
        }
      }
      out.write(scratch, static_cast<int>(rows), m_begin, g);
    }
  };
  // One contiguous piece per thread while a call is one row unit (decode sizes: each thread
  // streams its half of the panels in one run, 0.92 of the plain product above against 0.84
  // with four pieces each, whose heads the prefetch missed); four where rows are many (each
  // unit's work takes long enough that balance matters more).
  research_native::parallel_for(pool, row_units * groups, row_units == 1 ? 1 : 4, run);
}

// ---- 4-bit and 8-bit blocks as stored (GGUF's Q4_1 and Q8_0, AWQ int4) ---------------------
//
// A block is 32 consecutive k of one output column with float16 scales: Q4_1 w = d q + m
// (q 4-bit unsigned), Q8_0 w = d q (q int8), AWQ w = d (q - z) (q 4-bit unsigned, z its zero
// point, an integer 0..15 held as a float16 in Q4_1's m slot). A panel of 32 columns keeps, per k block, its
// columns' scales and then their codes, one 32-bit word per column and run of k (so a vector
// lane is a column and the codes come out with shifts and masks, on any instruction set): a
// product reads 0.625 (Q4_1) or 1.0625 (Q8_0) bytes per weight, as the file stores them.
//   Q4_1 (640 bytes): d[32] f16, m[32] f16, then words [4][32]: word (g, c) holds column c's
//                     codes for k = 8 g .. 8 g + 7, k = 8 g + t in bits 4 t .. 4 t + 3
//   AWQ (640 bytes):  as Q4_1, with z[32] in place of m
//   Q8_0 (1088 bytes): d[32] f16, then words [8][32]: word (g, c) holds column c's int8 codes
//                      for k = 4 g .. 4 g + 3, k = 4 g + t in byte t
// Per column and block: s = sum_k x_k q_k in float32 as two chains of fused multiply-adds in k
// order (Q4_1, AWQ: k < 16 and k >= 16; Q8_0: even and odd k), then y += d (s0 + s1), and for
// Q4_1 y += m sum_k x_k (AWQ: m = -(d z), exact in float32; the sum as block_sum takes it):
// sum_k x_k w_k rearranged, so it differs from a product with the dequantized weights by
// float32 rounding only.

// The sum of a block's 32 x in one fixed order on every instruction set (eight lanes, as GCC
// splits an 8-float vector into whatever the target has): lane l sums x[l], x[8 + l],
// x[16 + l], x[24 + l] in turn, then lanes l and l + 4, then l and l + 2, then the two left.
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));
inline float block_sum(const float* x) {
  const v8fu* p = reinterpret_cast<const v8fu*>(x);
  const v8f s = ((p[0] + p[1]) + p[2]) + p[3];
  const float a0 = s[0] + s[4], a1 = s[1] + s[5], a2 = s[2] + s[6], a3 = s[3] + s[7];
  return (a0 + a2) + (a1 + a3);
}

constexpr int kQ41Bytes = 640, kQ80Bytes = 1088;
constexpr int kFmtQ41 = 0, kFmtQ80 = 1, kFmtAwq = 2;  // the format attribute's codes
#if defined(__AVX512F__)
constexpr int kBlockRows = 2;
#else
constexpr int kBlockRows = 1;
#endif

typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));

// float16 bits (one per 32-bit lane) -> float32, exactly: normal numbers rebias the exponent,
// subnormals are their mantissa times 2^-24, infinities and NaNs keep an all-ones exponent.
inline vf f16_bits_to_f32(vu h) {
  const vu sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
  const vu normal = sign | ((em << 13) + 0x38000000u);
  const vu special = sign | 0x7F800000u | ((em & 0x3FFu) << 13);
  const vf tiny = __builtin_convertvector(reinterpret_cast<vi>(em), vf) * 5.9604645e-8f;
  const vu sub = sign | reinterpret_cast<vu>(tiny);
  return reinterpret_cast<vf>(em < 0x400u ? sub : (em >= 0x7C00u ? special : normal));
}

// kLanes float16 values -> float32 (F16C's vcvtph2ps by name on x86: GCC 12 converts a
// _Float16 vector one lane at a time, and has no _Float16 in C++ on ARM).
inline vf load_f16(const uint8_t* p) {
#if defined(__x86_64__) && defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__x86_64__) && defined(__AVX__) && defined(__F16C__)
  return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vh h;
  __builtin_memcpy(&h, p, sizeof(h));
  return f16_bits_to_f32(__builtin_convertvector(h, vu));
#endif
}

inline vu load_words(const uint8_t* p) { return *reinterpret_cast<const vuu*>(p); }

template <int kFmt>
constexpr int tile_bytes() {
  return kFmt == kFmtQ80 ? kQ80Bytes : kQ41Bytes;
}

// Tile kb of a panel, prefetching the stream kPrefetchBytes ahead of it where `prefetch`.
template <int kFmt>
inline const uint8_t* tile_at(const uint8_t* panel, int64_t kb, bool prefetch) {
  constexpr int kBytes = tile_bytes<kFmt>();
  const uint8_t* blk = panel + kb * kBytes;
  if (prefetch) {
    for (int line = 0; line < kBytes; line += 64) __builtin_prefetch(blk + kPrefetchBytes + line);
  }
  return blk;
}

// A tile's scales for kLanes columns from `col`: d, and m, the factor of the block's sum of x
// (Q4_1's m, AWQ's -(d z), exact in float32; none for Q8_0).
template <int kFmt>
inline void tile_scales(const uint8_t* blk, int col, vf& d, vf& m) {
  d = load_f16(blk + 2 * col);
  m = vf{};
  if constexpr (kFmt != kFmtQ80) {
    m = load_f16(blk + 64 + 2 * col);
    if constexpr (kFmt == kFmtAwq) m = -(d * m);
  }
}

// c[i, c0 .. c0 + kPassCols] for rows i < R; x: float32 rows (row i at x + i * ldx); xsum:
// each row's sum over each k block (row i at xsum + i * kbs; 4-bit formats only).
template <int R, int kFmt>
void block_rows(const uint8_t* panel, const float* x, int64_t ldx, const float* xsum,
                int64_t kbs, int c0, float* c) {
  constexpr bool kQ41 = kFmt != kFmtQ80;  // AWQ's codes are Q4_1's
  vf acc[R][kPassVecs] = {};
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* blk = tile_at<kFmt>(panel, kb, c0 == 0);
    const float* xk = x + kb * 32;
    vf s0[R][kPassVecs] = {}, s1[R][kPassVecs] = {};
    if constexpr (kQ41) {
      const uint8_t* q = blk + 128;
      for (int g = 0; g < 2; ++g) {  // words g (k < 16, chain 0) and g + 2 (k >= 16, chain 1)
        vu wl[kPassVecs], wh[kPassVecs];
        for (int v = 0; v < kPassVecs; ++v) {
          wl[v] = load_words(q + (g * 32 + c0 + v * kLanes) * 4);
          wh[v] = load_words(q + ((g + 2) * 32 + c0 + v * kLanes) * 4);
        }
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          vf lo[kPassVecs], hi[kPassVecs];
          for (int v = 0; v < kPassVecs; ++v) {
            lo[v] = __builtin_convertvector(reinterpret_cast<vi>((wl[v] >> (4 * t)) & 15u), vf);
            hi[v] = __builtin_convertvector(reinterpret_cast<vi>((wh[v] >> (4 * t)) & 15u), vf);
          }
          for (int i = 0; i < R; ++i) {
            const float xl = xk[i * ldx + 8 * g + t], xh = xk[i * ldx + 16 + 8 * g + t];
            for (int v = 0; v < kPassVecs; ++v) {
              s0[i][v] += xl * lo[v];
              s1[i][v] += xh * hi[v];
            }
          }
        }
      }
    } else {
      const uint8_t* q = blk + 64;
      for (int g = 0; g < 8; ++g) {
        vu w[kPassVecs];
        for (int v = 0; v < kPassVecs; ++v) w[v] = load_words(q + (g * 32 + c0 + v * kLanes) * 4);
#pragma GCC unroll 2
        for (int t = 0; t < 4; t += 2) {  // k = 4 g + t (even: chain 0), 4 g + t + 1 (odd: 1)
          vf e[kPassVecs], o[kPassVecs];
          for (int v = 0; v < kPassVecs; ++v) {
            e[v] = __builtin_convertvector(reinterpret_cast<vi>(w[v] << (24 - 8 * t)) >> 24, vf);
            o[v] = __builtin_convertvector(reinterpret_cast<vi>(w[v] << (16 - 8 * t)) >> 24, vf);
          }
          for (int i = 0; i < R; ++i) {
            const float xe = xk[i * ldx + 4 * g + t], xo = xk[i * ldx + 4 * g + t + 1];
            for (int v = 0; v < kPassVecs; ++v) {
              s0[i][v] += xe * e[v];
              s1[i][v] += xo * o[v];
            }
          }
        }
      }
    }
    for (int v = 0; v < kPassVecs; ++v) {
      vf d, m;
      tile_scales<kFmt>(blk, c0 + v * kLanes, d, m);
      for (int i = 0; i < R; ++i) acc[i][v] += d * (s0[i][v] + s1[i][v]);
      if constexpr (kQ41) {
        for (int i = 0; i < R; ++i) acc[i][v] += m * xsum[i * kbs + kb];
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < kPassVecs; ++v) {
      *reinterpret_cast<vfu*>(c + i * 32 + c0 + v * kLanes) = acc[i][v];
    }
  }
}

template <int R, int kFmt>
void block_rows_panel(const uint8_t* panel, const float* x, const float* xsum, int64_t k,
                      float* c) {
  for (int c0 = 0; c0 < 32; c0 += kPassCols) {
    block_rows<R, kFmt>(panel, x, k, xsum, k / 32, c0, c);
  }
}

// Several row blocks: a tile's codes are widened to float32 once (wt [32 k][32 columns], exact
// small integers) and every row block takes its products from there, in the same order and
// with the same roundings as block_rows (so a row's result never depends on its batch); acc
// [rows, 32] holds each row's running sum between tiles.
template <int kFmt>
void widen_tile(const uint8_t* blk, float* wt) {
  if constexpr (kFmt != kFmtQ80) {
    const uint8_t* q = blk + 128;
    for (int g = 0; g < 4; ++g) {
      for (int v = 0; v < 32 / kLanes; ++v) {
        const vu w = load_words(q + (g * 32 + v * kLanes) * 4);
        for (int t = 0; t < 8; ++t) {
          *reinterpret_cast<vf*>(wt + (8 * g + t) * 32 + v * kLanes) =
              __builtin_convertvector(reinterpret_cast<vi>((w >> (4 * t)) & 15u), vf);
        }
      }
    }
  } else {
    const uint8_t* q = blk + 64;
    for (int g = 0; g < 8; ++g) {
      for (int v = 0; v < 32 / kLanes; ++v) {
        const vu w = load_words(q + (g * 32 + v * kLanes) * 4);
        for (int t = 0; t < 4; ++t) {
          *reinterpret_cast<vf*>(wt + (4 * g + t) * 32 + v * kLanes) =
              __builtin_convertvector(reinterpret_cast<vi>(w << (24 - 8 * t)) >> 24, vf);
        }
      }
    }
  }
}

template <int R, int kFmt>
void tile_rows(const float* wt, const uint8_t* blk, const float* x, int64_t ldx,
               const float* xsum, int64_t kbs, int64_t kb, float* acc) {
  constexpr bool kQ41 = kFmt != kFmtQ80;
  const float* xk = x + kb * 32;
  for (int c0 = 0; c0 < 32; c0 += kPassCols) {
    vf s0[R][kPassVecs] = {}, s1[R][kPassVecs] = {};
    for (int j = 0; j < 16; ++j) {  // Q4_1, AWQ: k < 16 and k >= 16; Q8_0: even and odd k
      const int k0 = kQ41 ? j : 2 * j, k1 = kQ41 ? j + 16 : 2 * j + 1;
      vf w0[kPassVecs], w1[kPassVecs];
      for (int v = 0; v < kPassVecs; ++v) {
        w0[v] = *reinterpret_cast<const vf*>(wt + k0 * 32 + c0 + v * kLanes);
        w1[v] = *reinterpret_cast<const vf*>(wt + k1 * 32 + c0 + v * kLanes);
      }
      for (int i = 0; i < R; ++i) {
        const float x0 = xk[i * ldx + k0], x1 = xk[i * ldx + k1];
        for (int v = 0; v < kPassVecs; ++v) {
          s0[i][v] += x0 * w0[v];
          s1[i][v] += x1 * w1[v];
        }
      }
    }
    for (int v = 0; v < kPassVecs; ++v) {
      vf d, m;
      tile_scales<kFmt>(blk, c0 + v * kLanes, d, m);
      for (int i = 0; i < R; ++i) {
        vf a = *reinterpret_cast<const vf*>(acc + i * 32 + c0 + v * kLanes);
        a += d * (s0[i][v] + s1[i][v]);
        if constexpr (kQ41) a += m * xsum[i * kbs + kb];
        *reinterpret_cast<vf*>(acc + i * 32 + c0 + v * kLanes) = a;
      }
    }
  }
}

// ---- int8 activations: llama.cpp's arithmetic for its quantized dot products --------------
//
// Each row's 32-k block is quantized to int8 (as llama.cpp's Q8_0/Q8_1 activations): a = the
// block's largest |x|, dx = a / 127, q = rint(x * (1 / dx)) in float32 (0 where a = 0). A
// column's block product is then an exact integer, i = sum_k q_k c_k (c the weight's codes),
// taken four byte pairs at a time by the CPU's integer dot product (AVX512-VNNI / AVX-VNNI's
// vpdpbusd, AVX2's vpmaddubsw, ARM's sdot; plain vector code elsewhere: every one gives the
// same integer), and y += d (dx i), then for Q4_1 y += m sum_k x_k and for AWQ y += -(d z)
// sum_k x_k (the exact float32 sum of the block's x, as above). A 4-bit word's low nibbles hold
// k = 8 g, 8 g + 2, 8 g + 4, 8 g + 6 and its high nibbles the odd k, so a row's quantized block
// is kept as 8 words in that order (Q4_1, AWQ) or in k order (Q8_0, four k per word).

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool kDotFlipsQ80 = true;  // vpdpbusd multiplies unsigned codes: Q8_0's get + 128
#elif defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__) && defined(__AVXVNNI__)
constexpr bool kDotFlipsQ80 = true;
#else
constexpr bool kDotFlipsQ80 = false;
#endif

// acc += per lane sum_t a_t x_t over the lane's four bytes a_t (unsigned, < 128: a 4-bit code,
// or any unsigned byte where kDotFlipsQ80) and xw's four int8 bytes x_t.
inline vi dot_u8(vi acc, vu a, uint32_t xw) {
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512VNNI__)
  return reinterpret_cast<vi>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc),
                                                  reinterpret_cast<__m512i>(a),
                                                  _mm512_set1_epi32(static_cast<int>(xw))));
#elif defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__) && defined(__AVXVNNI__)
  return reinterpret_cast<vi>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc),
                                                      reinterpret_cast<__m256i>(a),
                                                      _mm256_set1_epi32(static_cast<int>(xw))));
#elif defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i p = _mm512_maddubs_epi16(reinterpret_cast<__m512i>(a),
                                         _mm512_set1_epi32(static_cast<int>(xw)));
  return acc + reinterpret_cast<vi>(_mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#elif defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i p = _mm256_maddubs_epi16(reinterpret_cast<__m256i>(a),
                                         _mm256_set1_epi32(static_cast<int>(xw)));
  return acc + reinterpret_cast<vi>(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return reinterpret_cast<vi>(vdotq_s32(reinterpret_cast<int32x4_t>(acc),
                                        reinterpret_cast<int8x16_t>(a),
                                        vreinterpretq_s8_s32(vdupq_n_s32(static_cast<int>(xw)))));
#else
  for (int t = 0; t < 4; ++t) {
    acc += reinterpret_cast<vi>((a >> (8 * t)) & 0xFFu) * static_cast<int8_t>(xw >> (8 * t));
  }
  return acc;
#endif
}

// acc += per lane sum_t a_t x_t with signed bytes a_t (Q8_0's codes; not used where
// kDotFlipsQ80, which offsets them into dot_u8's range instead).
inline vi dot_s8(vi acc, vu a, uint32_t xw) {
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i av = reinterpret_cast<__m512i>(a), x = _mm512_set1_epi32(static_cast<int>(xw));
  const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(av), _mm512_setzero_si512(), x);
  const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(av), xs);  // |a| <= 128: no saturation
  return acc + reinterpret_cast<vi>(_mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#elif defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i av = reinterpret_cast<__m256i>(a), x = _mm256_set1_epi32(static_cast<int>(xw));
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(av), _mm256_sign_epi8(x, av));
  return acc + reinterpret_cast<vi>(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return dot_u8(acc, a, xw);  // sdot: signed bytes on both sides
#else
  for (int t = 0; t < 4; ++t) {
    acc += (reinterpret_cast<vi>(a << (24 - 8 * t)) >> 24) * static_cast<int8_t>(xw >> (8 * t));
  }
  return acc;
#endif
}

// One row's 32-k blocks quantized: words [kbs, 8] (the kernel's k order for the format), dx
// [kbs] and, where kDotFlipsQ80, the sum of each block's q [kbs] (Q8_0's correction).
// (Built without contraction: x * (1 / dx) is rounded to float32 before it is rounded to an
// integer, as the emulation does, never fused into the rounding's add.)
template <int kFmt>
__attribute__((optimize("fp-contract=off"))) void quantize_row(const float* x, int64_t kbs,
                                                              uint32_t* words, float* dx,
                                                              int32_t* qsum) {
  constexpr int kV = 32 / kLanes;
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const float* xb = x + kb * 32;
    vf v[kV], top = {};
    for (int j = 0; j < kV; ++j) {
      v[j] = *reinterpret_cast<const vfu*>(xb + j * kLanes);
      const vf a = reinterpret_cast<vf>(reinterpret_cast<vu>(v[j]) & 0x7FFFFFFFu);
      top = (a > top || a != a) ? a : top;  // a NaN stays (the block's result is NaN)
    }
    float amax = top[0];
    for (int l = 1; l < kLanes; ++l) amax = (top[l] > amax || top[l] != top[l]) ? top[l] : amax;
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t q[32];
    vi total = {};
    for (int j = 0; j < kV; ++j) {
      vf r = v[j] * inv;
      r = (r + 12582912.0f) - 12582912.0f;  // to the nearest integer, ties to even (|r| <= 127)
      r = r > 127.0f ? 127.0f : r;
      r = r < -127.0f ? -127.0f : r;
      const vi qi = r == r ? __builtin_convertvector(r, vi) : vi{};
      total += qi;
      for (int l = 0; l < kLanes; ++l) q[j * kLanes + l] = static_cast<int8_t>(qi[l]);
    }
    int32_t sum = 0;
    for (int l = 0; l < kLanes; ++l) sum += total[l];
    uint32_t* w = words + kb * 8;
    for (int i = 0; i < 8; ++i) {
      // Q4_1 / AWQ: word 2 g holds k = 8 g + 2 t, word 2 g + 1 k = 8 g + 2 t + 1 (t = byte);
      // Q8_0: word i holds k = 4 i + t
      uint32_t packed = 0;
      for (int t = 0; t < 4; ++t) {
        const int k = kFmt == kFmtQ80 ? 4 * i + t : 8 * (i / 2) + 2 * t + (i % 2);
        packed |= uint32_t{static_cast<uint8_t>(q[k])} << (8 * t);
      }
      w[i] = packed;
    }
    dx[kb] = d;
    qsum[kb] = sum;
  }
}

// c[i, 0 .. 32] for rows i < R of a panel with int8 activations (row i's words at xw + i *
// kbs * 8, its block scales at dx + i * kbs ...).
template <int R, int kFmt>
void int_rows(const uint8_t* panel, const uint32_t* xw, const float* dx, const float* xsum,
              const int32_t* qsum, int64_t kbs, int c0, float* c) {
  constexpr bool kQ41 = kFmt != kFmtQ80;
  vf acc[R][kPassVecs] = {};
  for (int64_t kb = 0; kb < kbs; ++kb) {
    const uint8_t* blk = tile_at<kFmt>(panel, kb, c0 == 0);
    vi s[R][kPassVecs] = {};
    if constexpr (kQ41) {
      const uint8_t* q = blk + 128;
      for (int g = 0; g < 4; ++g) {
        for (int v = 0; v < kPassVecs; ++v) {
          const vu w = load_words(q + (g * 32 + c0 + v * kLanes) * 4);
          const vu lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
          for (int i = 0; i < R; ++i) {
            const uint32_t* xr = xw + (i * kbs + kb) * 8;
            s[i][v] = dot_u8(s[i][v], lo, xr[2 * g]);
            s[i][v] = dot_u8(s[i][v], hi, xr[2 * g + 1]);
          }
        }
      }
    } else {
      const uint8_t* q = blk + 64;
      for (int g = 0; g < 8; ++g) {
        for (int v = 0; v < kPassVecs; ++v) {
          const vu w = load_words(q + (g * 32 + c0 + v * kLanes) * 4);
          for (int i = 0; i < R; ++i) {
            const uint32_t x4 = xw[(i * kbs + kb) * 8 + g];
            if constexpr (kDotFlipsQ80) {
              s[i][v] = dot_u8(s[i][v], w ^ 0x80808080u, x4);
            } else {
              s[i][v] = dot_s8(s[i][v], w, x4);
            }
          }
        }
      }
    }
    for (int v = 0; v < kPassVecs; ++v) {
      vf d, m;
      tile_scales<kFmt>(blk, c0 + v * kLanes, d, m);
      for (int i = 0; i < R; ++i) {
        vi total = s[i][v];
        if constexpr (!kQ41 && kDotFlipsQ80) total -= 128 * qsum[i * kbs + kb];
        acc[i][v] += d * (dx[i * kbs + kb] * __builtin_convertvector(total, vf));
        if constexpr (kQ41) acc[i][v] += m * xsum[i * kbs + kb];
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    for (int v = 0; v < kPassVecs; ++v) {
      *reinterpret_cast<vfu*>(c + i * 32 + c0 + v * kLanes) = acc[i][v];
    }
  }
}

template <int R, int kFmt>
void int_rows_panel(const uint8_t* panel, const uint32_t* xw, const float* dx, const float* xsum,
                    const int32_t* qsum, int64_t kbs, float* c) {
  for (int c0 = 0; c0 < 32; c0 += kPassCols) {
    int_rows<R, kFmt>(panel, xw, dx, xsum, qsum, kbs, c0, c);
  }
}

// y = x @ W for a Q4_1, Q8_0 or AWQ panel stream w [N/32, K/32, bytes]; x float32 or bfloat16.
template <int kFmt>
void block_gemm(ffi::ThreadPool& pool, int64_t m, int64_t k, int64_t n, const void* xp,
                bool x_bf16, bool int8, const uint8_t* wp, const Output& out) {
  const int64_t groups = n / 32, kbs = k / 32;
  const int64_t panel_bytes = kbs * tile_bytes<kFmt>();
  const int64_t row_units = (m + kVecUnitRows - 1) / kVecUnitRows;
  auto run = [=](int64_t begin, int64_t end) {
    alignas(64) float scratch[kBlockRows * 32];
    alignas(64) float wt[32 * 32];                 // one tile's codes in float32
    alignas(64) float acc[kVecUnitRows * 32];      // the unit's running sums
    alignas(64) float rows_out[kVecRows * 32];
    // The current row unit in float32, its block sums; int8 activations: its quantized
    // blocks, their scales and code sums (each thread's buffers outlive the call).
    thread_local std::vector<float> widened, sums, dx;
    thread_local std::vector<uint32_t> xw;
    thread_local std::vector<int32_t> qsum;
    int64_t have = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t g = u % groups, unit = u / groups;
      const int64_t m_begin = unit * kVecUnitRows;
      const int64_t m_end = std::min(m, m_begin + kVecUnitRows);
      if (have != unit) {
        const int64_t count = (m_end - m_begin) * k;
        widened.resize(count);
        float* dst = widened.data();
        if (x_bf16) {
          const uint16_t* src = static_cast<const uint16_t*>(xp) + m_begin * k;
          for (int64_t i = 0; i < count; ++i) dst[i] = research_native::to_f32(src[i]);
        } else {
          const float* src = static_cast<const float*>(xp) + m_begin * k;
          std::copy(src, src + count, dst);
        }
        sums.resize((m_end - m_begin) * kbs);
        for (int64_t b = 0; b < (m_end - m_begin) * kbs; ++b) sums[b] = block_sum(dst + b * 32);
        if (int8) {
          const int64_t rows = m_end - m_begin;
          xw.resize(rows * kbs * 8);
          dx.resize(rows * kbs);
          qsum.resize(rows * kbs);
          for (int64_t i = 0; i < rows; ++i) {
            quantize_row<kFmt>(dst + i * k, kbs, xw.data() + i * kbs * 8, dx.data() + i * kbs,
                               qsum.data() + i * kbs);
          }
        }
        have = unit;
      }
      const uint8_t* panel = wp + g * panel_bytes;
      const int64_t rows_in_unit = m_end - m_begin;
      if (int8) {  // kVecRows rows at a time over the panel (cached after the first)
        for (int64_t i0 = 0; i0 < rows_in_unit; i0 += kVecRows) {
          const int64_t off = i0 * kbs;
          const uint32_t* xr = xw.data() + off * 8;
          const float *dr = dx.data() + off, *sr = sums.data() + off;
          const int32_t* qr = qsum.data() + off;
          const int rows = static_cast<int>(std::min<int64_t>(kVecRows, rows_in_unit - i0));
          switch (rows) {
            case 1: int_rows_panel<1, kFmt>(panel, xr, dr, sr, qr, kbs, rows_out); break;
            case 2: int_rows_panel<2, kFmt>(panel, xr, dr, sr, qr, kbs, rows_out); break;
            case 3: int_rows_panel<3, kFmt>(panel, xr, dr, sr, qr, kbs, rows_out); break;
            default: int_rows_panel<kVecRows, kFmt>(panel, xr, dr, sr, qr, kbs, rows_out); break;
          }
          out.write(rows_out, rows, m_begin + i0, g);
        }
        continue;
      }
      if (rows_in_unit > kBlockRows) {  // widen each tile once for all the unit's rows
        std::fill(acc, acc + rows_in_unit * 32, 0.0f);
        for (int64_t kb = 0; kb < kbs; ++kb) {
          const uint8_t* blk = tile_at<kFmt>(panel, kb, true);
          widen_tile<kFmt>(blk, wt);
          for (int64_t i0 = 0; i0 < rows_in_unit; i0 += kVecRows) {
            const float* xr = widened.data() + i0 * k;
            const float* sr = sums.data() + i0 * kbs;
            switch (std::min<int64_t>(kVecRows, rows_in_unit - i0)) {
              case 1: tile_rows<1, kFmt>(wt, blk, xr, k, sr, kbs, kb, acc + i0 * 32); break;
              case 2: tile_rows<2, kFmt>(wt, blk, xr, k, sr, kbs, kb, acc + i0 * 32); break;
              case 3: tile_rows<3, kFmt>(wt, blk, xr, k, sr, kbs, kb, acc + i0 * 32); break;
              default:
                tile_rows<kVecRows, kFmt>(wt, blk, xr, k, sr, kbs, kb, acc + i0 * 32);
                break;
            }
          }
        }
        out.write(acc, static_cast<int>(rows_in_unit), m_begin, g);
        continue;
      }
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, m_end - m0));
        const float* xr = widened.data() + (m0 - m_begin) * k;
        const float* sr = sums.data() + (m0 - m_begin) * kbs;
        if (rows == kBlockRows) {
          block_rows_panel<kBlockRows, kFmt>(panel, xr, sr, k, scratch);
        } else {
          block_rows_panel<1, kFmt>(panel, xr, sr, k, scratch);
        }
        out.write(scratch, rows, m0, g);
      }
    }
  };
  // As the vector kernel: one piece per thread at decode sizes (a step's Q4_1 projections
  // 0.40 -> 0.43 of the plain bf16 product's read rate).
  research_native::parallel_for(pool, row_units * groups, row_units == 1 ? 1 : 4, run);
}

// Which kernel serves a call: 0 auto (AMX where the CPU grants it, else the vector kernel),
// 1 the vector kernel, 2 AMX (an error where there is none).
constexpr int32_t kAuto = 0, kVector = 1, kAmx = 2;

bool check_output(ffi::DataType type, const char* name, ffi::Error* err) {
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16) {
    *err = ffi::Error::InvalidArgument(std::string(name) +
                                       ": the output must be float32 or bfloat16");
    return false;
  }
  return true;
}

// A weight operand: one matrix's panels (`rank` dimensions), or a stack of every decoder
// layer's ([L, ...], read at `layer`): a step passes each stack once rather than one buffer
// per layer (each argument of a jitted call costs the dispatch a few microseconds).
struct WeightView {
  const void* data = nullptr;
  int64_t dims[8] = {};
};

template <class Buffer>
bool weight_view(const Buffer& w, size_t rank, int32_t layer, int64_t elem_bytes, WeightView* v) {
  auto wd = w.dimensions();
  if (wd.size() != rank && wd.size() != rank + 1) return false;
  const size_t lead = wd.size() - rank;  // 1 for a stack
  if (lead == 0 ? layer != 0 : (layer < 0 || layer >= wd[0])) return false;
  int64_t bytes = elem_bytes;
  for (size_t i = 0; i < rank; ++i) {
    v->dims[i] = wd[lead + i];
    bytes *= wd[lead + i];
  }
  v->data = static_cast<const char*>(w.untyped_data()) + (lead ? layer * bytes : 0);
  return true;
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    int32_t epilogue, int32_t kernel, int32_t layer,
                    ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions();
  WeightView wv;
  if (!weight_view(w, 5, layer, 2, &wv)) {
    return ffi::Error::InvalidArgument("gemm_bf16: w must be [N/32, K/32, 16, 2, 32], or a stack "
                                       "of them with 0 <= layer < its length");
  }
  const int64_t* wd = wv.dims;
  auto yd = y->dimensions();
  const bool swiglu = epilogue == 1;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != 16 || wd[3] != 2 ||
      wd[4] != 32 || xd[1] != wd[1] * 32 || yd[0] != xd[0] ||
      yd[1] != wd[0] * (swiglu ? 16 : 32) || epilogue < 0 || epilogue > 1) {
    return ffi::Error::InvalidArgument("gemm_bf16: inconsistent shapes");
  }
  ffi::Error err = ffi::Error::Success();
  if (!check_output(y->element_type(), "gemm_bf16", &err)) return err;
  if (kernel < kAuto || kernel > kAmx) {
    return ffi::Error::InvalidArgument("gemm_bf16: kernel must be 0 (auto), 1 or 2");
  }
  if (kernel == kAmx && !amx_ready()) {
    return ffi::Error::Internal("gemm_bf16: this CPU has no usable AMX-BF16");
  }
  if (xd[0] > 0) {
    const Output out{y->untyped_data(), y->element_type() == ffi::DataType::BF16, swiglu, yd[1]};
    const auto* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
    const auto* wp = static_cast<const uint16_t*>(wv.data);
    if (kernel == kAmx || (kernel == kAuto && amx_ready())) {
      gemm(pool, xd[0], xd[1], wd[0] * 32, xp, wp, out);
    } else {
      vec_gemm<uint16_t>(pool, xd[0], xd[1], wd[0] * 32, xp, wp, out);
    }
  }
  return ffi::Error::Success();
}

// x [M, K] float32 @ W packed as [N/32, K, 32] float32 -> y [M, N] (or the swiglu half).
ffi::Error GemmF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       int32_t epilogue, int32_t layer, ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions();
  WeightView wv;
  if (!weight_view(w, 3, layer, 4, &wv)) {
    return ffi::Error::InvalidArgument("gemm_f32: w must be [N/32, K, 32], or a stack of them "
                                       "with 0 <= layer < its length");
  }
  const int64_t* wd = wv.dims;
  auto yd = y->dimensions();
  const bool swiglu = epilogue == 1;
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != 32 || xd[1] != wd[1] ||
      yd[0] != xd[0] || yd[1] != wd[0] * (swiglu ? 16 : 32) || epilogue < 0 || epilogue > 1) {
    return ffi::Error::InvalidArgument("gemm_f32: inconsistent shapes");
  }
  ffi::Error err = ffi::Error::Success();
  if (!check_output(y->element_type(), "gemm_f32", &err)) return err;
  if (xd[0] > 0) {
    const Output out{y->untyped_data(), y->element_type() == ffi::DataType::BF16, swiglu, yd[1]};
    vec_gemm<float>(pool, xd[0], xd[1], wd[0] * 32, x.typed_data(),
                    static_cast<const float*>(wv.data), out);
  }
  return ffi::Error::Success();
}

// x [M, K] float32 or bfloat16 @ W as blocks in panels [N/32, K/32, bytes] (uint8), format
// 0: Q4_1, 1: Q8_0, 2: AWQ -> y [M, N] (or the swiglu half) float32 or bfloat16.
ffi::Error GemmBlocksImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> w,
                          int32_t format, int32_t epilogue, int32_t activations, int32_t layer,
                          ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions();
  WeightView wv;
  if (!weight_view(w, 3, layer, 1, &wv)) {
    return ffi::Error::InvalidArgument("gemm_blocks: w must be [N/32, K/32, bytes], or a stack "
                                       "of them with 0 <= layer < its length");
  }
  const int64_t* wd = wv.dims;
  auto yd = y->dimensions();
  const bool swiglu = epilogue == 1;
  const int64_t bytes = format == kFmtQ80 ? kQ80Bytes : kQ41Bytes;
  if (format < 0 || format > 2 || epilogue < 0 || epilogue > 1 || activations < 0 ||
      activations > 1) {
    return ffi::Error::InvalidArgument(
        "gemm_blocks: format must be 0, 1 or 2, epilogue 0 or 1, activations 0 (float) or 1 "
        "(int8)");
  }
  if (xd.size() != 2 || yd.size() != 2 || wd[2] != bytes ||
      xd[1] != wd[1] * 32 || yd[0] != xd[0] || yd[1] != wd[0] * (swiglu ? 16 : 32)) {
    return ffi::Error::InvalidArgument("gemm_blocks: inconsistent shapes");
  }
  const auto xt = x.element_type();
  if (xt != ffi::DataType::F32 && xt != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("gemm_blocks: x must be float32 or bfloat16");
  }
  ffi::Error err = ffi::Error::Success();
  if (!check_output(y->element_type(), "gemm_blocks", &err)) return err;
  if (xd[0] > 0) {
    const Output out{y->untyped_data(), y->element_type() == ffi::DataType::BF16, swiglu, yd[1]};
    const bool x_bf16 = xt == ffi::DataType::BF16;
    const auto* wp = static_cast<const uint8_t*>(wv.data);
    const int64_t m = xd[0], k = xd[1], n = wd[0] * 32;
    const void* xp = x.untyped_data();
    const bool int8 = activations == 1;
    if (format == kFmtQ41) {
      block_gemm<kFmtQ41>(pool, m, k, n, xp, x_bf16, int8, wp, out);
    } else if (format == kFmtQ80) {
      block_gemm<kFmtQ80>(pool, m, k, n, xp, x_bf16, int8, wp, out);
    } else {
      block_gemm<kFmtAwq>(pool, m, k, n, xp, x_bf16, int8, wp, out);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" int ResearchAmxReady() { return amx_ready() ? 1 : 0; }

// Whether this build fuses multiply-adds (one rounding each): true wherever the target has FMA
// (x86-64-v3 and later, every 64-bit ARM); an SSE-only build rounds the product and the sum.
extern "C" int ResearchGemmFma() {
#if defined(__FMA__) || defined(__aarch64__) || defined(__ARM_FEATURE_FMA)
  return 1;
#else
  return 0;
#endif
}

// Whether the vector kernel's bfloat16 products take vdpbf16ps here (bf16_dot).
extern "C" int ResearchGemmBf16Dot() { return bf16_dot() ? 1 : 0; }

// The vector kernel's instruction set in this build (what ``-march`` gave the compiler).
extern "C" const char* ResearchGemmVectorIsa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#elif defined(__ARM_FEATURE_SVE)
  return "sve";
#elif defined(__ARM_NEON)
  return "neon";
#else
  return "generic";
#endif
}

// ---- A plain read on the kernels' threads (the yardstick of bench_gemm --chain) -------------
//
// The wrapping sum of a buffer's 32-bit words: its bytes stream through the kernels' own pool,
// one contiguous piece per thread as a decode-sized product streams its panels, with none of
// the product's arithmetic. A step's projections held against this over the same buffers, in
// the same process and minute, say what the kernels lose to their arithmetic and layout alone
// (a jnp.sum of one large buffer on XLA's pool read 0.82-0.95 of a plain two-thread loop).
// `start` is added to the sum: chaining calls through it keeps them one after another.
ffi::Error StreamImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> start,
                      ffi::Result<ffi::Buffer<ffi::U32>> out) {
  const auto* p = static_cast<const uint32_t*>(x.untyped_data());
  const int64_t words = static_cast<int64_t>(x.size_bytes() / 4);
  constexpr int64_t kUnitWords = 4096;  // 16 KB
  std::atomic<uint32_t> total{0};
  research_native::parallel_for(pool, (words + kUnitWords - 1) / kUnitWords, 1,
                                [&](int64_t begin, int64_t end) {
    vu s0 = {}, s1 = {}, s2 = {}, s3 = {};
    int64_t i = begin * kUnitWords;
    const int64_t stop = std::min(words, end * kUnitWords);
    for (; i + 4 * kLanes <= stop; i += 4 * kLanes) {
      s0 += *reinterpret_cast<const vuu*>(p + i);
      s1 += *reinterpret_cast<const vuu*>(p + i + kLanes);
      s2 += *reinterpret_cast<const vuu*>(p + i + 2 * kLanes);
      s3 += *reinterpret_cast<const vuu*>(p + i + 3 * kLanes);
    }
    const vu sum = s0 + s1 + s2 + s3;
    uint32_t t = 0;
    for (int l = 0; l < kLanes; ++l) t += sum[l];
    for (; i < stop; ++i) t += p[i];
    total.fetch_add(t, std::memory_order_relaxed);
  });
  *out->typed_data() = *start.typed_data() + total.load();
  return ffi::Error::Success();
}

// ---- Greedy sampling over a step's logits -----------------------------------------------
//
// logits [R, V] float32 -> best [R] int32, gap [R] float32: each row's argmax (the lowest index
// among equal maxima; a row holding a NaN: its first NaN) and its largest logit less the largest
// of the others (0 when the maximum appears twice; NaN in a row with a NaN), as
// research.engine.sampler.greedy computes them in XLA, whose two [R, V] selects and three
// reductions took ~5% of a 64-row decode step. One vectorized pass per row keeps each lane's
// two largest values (a value equal to the largest counts as the second) and where its largest
// first was; the lanes and the tail then merge in index order. Rows over the cores.
ffi::Error GreedyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Result<ffi::Buffer<ffi::S32>> best, ffi::Result<ffi::Buffer<ffi::F32>> gap) {
  auto d = logits.dimensions();
  if (d.size() != 2 || best->dimensions().size() != 1 || best->dimensions()[0] != d[0] ||
      gap->dimensions().size() != 1 || gap->dimensions()[0] != d[0] || d[1] < 1 ||
      d[1] > std::numeric_limits<int32_t>::max()) {
    return ffi::Error::InvalidArgument("greedy: logits [R, V >= 1] -> best [R], gap [R]");
  }
  const int64_t rows = d[0], vocab = d[1];
  const float* x = logits.typed_data();
  int32_t* bp = best->typed_data();
  float* gp = gap->typed_data();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));
  research_native::parallel_for(pool, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      vf m1 = vf{} + kNegInf, m2 = m1;
      vi32 at = {}, iv = {};
      for (int l = 0; l < kLanes; ++l) at[l] = iv[l] = l;
      vi32 nan = {};
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes, iv += kLanes) {
        const vf v = *reinterpret_cast<const vfu*>(row + i);
        const vi32 gt1 = v > m1, gt2 = v > m2;
        m2 = gt1 ? m1 : (gt2 ? v : m2);
        at = gt1 ? iv : at;
        m1 = gt1 ? v : m1;
        nan |= v != v;
      }
      bool has_nan = false;
      for (int l = 0; l < kLanes; ++l) has_nan |= nan[l] != 0;
      for (int64_t j = i; j < vocab; ++j) has_nan |= std::isnan(row[j]);
      if (has_nan) {  // the first NaN, as argmax (and max propagates it into the gap)
        int64_t first = 0;
        while (!std::isnan(row[first])) ++first;
        bp[r] = static_cast<int32_t>(first);
        gp[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      // Lanes: the largest, its first index, and the largest of what is left once one lane's
      // copy of it is taken out.
      float top = kNegInf;
      for (int l = 0; l < kLanes; ++l) top = std::max(top, m1[l]);
      int lane = -1;
      int64_t where = 0;
      for (int l = 0; l < kLanes; ++l) {
        if (m1[l] == top && (lane < 0 || at[l] < where)) lane = l, where = at[l];
      }
      float second = kNegInf;
      for (int l = 0; l < kLanes; ++l) {
        second = std::max(second, m2[l]);
        if (l != lane) second = std::max(second, m1[l]);
      }
      for (; i < vocab; ++i) {  // the tail, after every lane's elements
        const float v = row[i];
        if (v > top) {
          second = top;
          top = v;
          where = i;
        } else if (v > second) {
          second = v;
        }
      }
      bp[r] = static_cast<int32_t>(where);
      gp[r] = top - second;
    }
  });
  return ffi::Error::Success();
}

// ---- RMSNorm, with the residual add before it ------------------------------------------
//
// x [M, D], delta [M, D], weight [D] (or a stack [L, D] and the layer to read), one dtype
// (bfloat16 or float32) -> sum = x + delta and
// normed = weight * dtype(s * rsqrt(mean(s * s) + eps)), s = float32(sum):
// research.models.layers.rms_norm's arithmetic on the residual stream's sum, each operation
// rounded to the dtype where the model's code rounds it (inside a step XLA fuses the add into
// the norm and squares the sum before rounding it, so the two differ in the last bf16 bit of
// some values; against XLA on a materialized sum this is bit for bit). A decoder layer's two
// norms took five XLA fusions each (the add, the squares, a windowed sum, the rsqrt, the
// scaling): ten of a SmolLM2 layer's fourteen, each a few microseconds of a decode step's
// thunks. The sum of squares is float32, 16 lanes (lane l: elements l, l + 16, ... in turn;
// the tail after) and then the lanes in a fixed tree: a row's result never depends on the
// other rows. Without delta (RmsNorm): s = float32(x).
using research_native::to_f32;

template <typename T>
T store_f(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return research_native::to_bf16(f);
  }
}

// f rounded to T (nearest even for bfloat16), back in float32.
template <typename T>
float rounded(float f) {
  return to_f32(store_f<T>(f));
}

template <typename T>
void norm_rows(const T* x, const T* delta, const T* w, T* sum, T* normed, int64_t d, float eps,
               int64_t begin, int64_t end) {
  using research_native::v16;
  for (int64_t row = begin; row < end; ++row) {
    const T* xr = x + row * d;
    const T* dr = delta == nullptr ? nullptr : delta + row * d;
    T* sr = sum == nullptr ? nullptr : sum + row * d;
    T* nr = normed + row * d;
    v16 acc = {};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
      v16 s;
      for (int l = 0; l < 16; ++l) {
        float v = to_f32(xr[i + l]);
        if (dr != nullptr) {
          v = rounded<T>(v + to_f32(dr[i + l]));
          sr[i + l] = store_f<T>(v);
        }
        s[l] = v;
      }
      acc += s * s;
    }
    float tail = 0.0f;
    for (int64_t j = i; j < d; ++j) {
      float v = to_f32(xr[j]);
      if (dr != nullptr) {
        v = rounded<T>(v + to_f32(dr[j]));
        sr[j] = store_f<T>(v);
      }
      tail += v * v;
    }
    float lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = acc[l];
    for (int width = 8; width >= 1; width /= 2) {
      for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    }
    const float mean = (lanes[0] + tail) / static_cast<float>(d);
    const float r = 1.0f / std::sqrt(mean + eps);
    const T* src = dr != nullptr ? sr : xr;
    for (int64_t j = 0; j < d; ++j) {
      nr[j] = store_f<T>(to_f32(w[j]) * rounded<T>(to_f32(src[j]) * r));
    }
  }
}

ffi::Error norm_impl(ffi::ThreadPool& pool, ffi::AnyBuffer& x, ffi::AnyBuffer* delta,
                     ffi::AnyBuffer& w, float eps, int32_t layer, ffi::AnyBuffer* sum,
                     ffi::AnyBuffer& normed) {
  const auto type = x.element_type();
  const auto wd = w.dimensions();
  const int64_t d = wd.size() == 0 ? 0 : wd.back();
  const int64_t layers = wd.size() == 2 ? wd[0] : 1;
  const int64_t n = static_cast<int64_t>(x.element_count());
  bool same = w.element_type() == type && normed.element_type() == type &&
              normed.element_count() == x.element_count();
  if (delta != nullptr) {
    same = same && delta->element_type() == type && sum->element_type() == type &&
           delta->element_count() == x.element_count() &&
           sum->element_count() == x.element_count();
  }
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16) || !same) {
    return ffi::Error::InvalidArgument(
        "rms_norm: x, delta, weight and the outputs must share one dtype, bfloat16 or float32, "
        "and x, delta and the outputs one size");
  }
  if (d < 1 || (wd.size() != 1 && wd.size() != 2) || x.dimensions().size() == 0 ||
      x.dimensions().back() != d) {
    return ffi::Error::InvalidArgument(
        "rms_norm: x [..., D] takes a weight [D], or a stack of them [L, D] and its layer");
  }
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("rms_norm: layer " + std::to_string(layer) +
                                       " is outside the weight's " + std::to_string(layers));
  }
  const int64_t rows = n / d;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* dp = delta == nullptr ? nullptr : static_cast<const T*>(delta->untyped_data());
    T* sp = sum == nullptr ? nullptr : static_cast<T*>(sum->untyped_data());
    auto rows_fn = [&](int64_t begin, int64_t end) {
      norm_rows<T>(static_cast<const T*>(x.untyped_data()), dp,
                   static_cast<const T*>(w.untyped_data()) + layer * d, sp,
                   static_cast<T*>(normed.untyped_data()), d, eps, begin, end);
    };
    // A decode step's few rows take a microsecond: on the calling thread; many rows over the
    // cores.
    if (n < (int64_t{1} << 16)) {
      rows_fn(0, rows);
    } else {
      research_native::parallel_for(pool, rows, 1, rows_fn);
    }
  };
  if (type == ffi::DataType::F32) {
    run(float{});
  } else {
    run(uint16_t{});
  }
  return ffi::Error::Success();
}

ffi::Error AddRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer delta,
                          ffi::AnyBuffer w, float eps, int32_t layer,
                          ffi::Result<ffi::AnyBuffer> sum, ffi::Result<ffi::AnyBuffer> normed) {
  return norm_impl(pool, x, &delta, w, eps, layer, &(*sum), *normed);
}

ffi::Error RmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, float eps,
                       int32_t layer, ffi::Result<ffi::AnyBuffer> normed) {
  return norm_impl(pool, x, nullptr, w, eps, layer, nullptr, *normed);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNorm, AddRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Greedy, GreedyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmBf16, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int32_t>("epilogue")
                                  .Attr<int32_t>("kernel")
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmF32, GemmF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("epilogue")
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmBlocks, GemmBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int32_t>("format")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<int32_t>("activations")
                                  .Attr<int32_t>("layer")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Stream, StreamImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());
