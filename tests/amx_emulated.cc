// research/native/gemm.cc with its AMX instructions emulated: every tile intrinsic the AMX
// kernel calls is replaced by a scalar version over tile registers held as arrays, the CPUID
// check answers "AMX-TILE and AMX-BF16" and the OS's grant of the tile state succeeds. Built by
// tests/test_native_gemm.py on any x86-64 CPU, so the AMX kernel's tiling (its row pairs and
// tails, units, epilogues) and the panel layout it reads are tested where no AMX unit is; the
// real unit's tests run where one is.
//
// TDPBF16PS per Intel's pseudo-code: C[m][n] += A[m][2p] B[p][2n] + A[m][2p+1] B[p][2n+1] over
// the pairs p, each product exact in float32 and added in p order (the unit's own rounding of
// the pair's sum is not reproduced: the tests hold it to a float64 reference's tolerance).

#include <cpuid.h>
#include <immintrin.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace amx_emulated {

struct Config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

struct Tile {
  int rows = 0, colsb = 0;
  alignas(64) uint8_t data[16][64];
};

thread_local Tile tiles[8];

inline void loadconfig(const void* cfg) {
  Config c;
  std::memcpy(&c, cfg, sizeof(c));
  for (int t = 0; t < 8; ++t) {
    tiles[t].rows = c.rows[t];
    tiles[t].colsb = c.colsb[t];
  }
}

inline void zero(int t) { std::memset(tiles[t].data, 0, sizeof(tiles[t].data)); }

inline void loadd(int t, const void* base, long stride) {
  for (int r = 0; r < tiles[t].rows; ++r) {
    std::memcpy(tiles[t].data[r], static_cast<const char*>(base) + r * stride, tiles[t].colsb);
  }
}

inline void stored(int t, void* base, long stride) {
  for (int r = 0; r < tiles[t].rows; ++r) {
    std::memcpy(static_cast<char*>(base) + r * stride, tiles[t].data[r], tiles[t].colsb);
  }
}

inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  Tile &tc = tiles[c], &ta = tiles[a], &tb = tiles[b];
  for (int m = 0; m < tc.rows; ++m) {
    for (int n = 0; n < tc.colsb / 4; ++n) {
      float acc;
      std::memcpy(&acc, tc.data[m] + 4 * n, 4);
      for (int p = 0; p < ta.colsb / 4; ++p) {
        acc += bf16(ta.data[m] + 4 * p) * bf16(tb.data[p] + 4 * n);
        acc += bf16(ta.data[m] + 4 * p + 2) * bf16(tb.data[p] + 4 * n + 2);
      }
      std::memcpy(tc.data[m] + 4 * n, &acc, 4);
    }
  }
}

// CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16.
inline int cpuid(unsigned, unsigned, unsigned* a, unsigned* b, unsigned* c, unsigned* d) {
  *a = *b = *c = 0;
  *d = (1u << 24) | (1u << 22);
  return 1;
}

}  // namespace amx_emulated

#undef _tile_loadconfig
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadconfig(cfg) amx_emulated::loadconfig(cfg)
#define _tile_zero(t) amx_emulated::zero(t)
#define _tile_loadd(t, base, stride) amx_emulated::loadd(t, base, stride)
#define _tile_stored(t, base, stride) amx_emulated::stored(t, base, stride)
#define _tile_dpbf16ps(c, a, b) amx_emulated::dpbf16ps(c, a, b)
#define _tile_release() ((void)0)
#define __get_cpuid_count(leaf, sub, a, b, c, d) amx_emulated::cpuid(leaf, sub, a, b, c, d)
#define syscall(...) 0L

#include "../research/native/gemm.cc"
