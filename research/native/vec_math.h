// 16-lane float32 vectors (GCC/Clang vector extensions, so the same source builds for any
// target) and the vector math the native kernels share.
#pragma once

#include <cstdint>

namespace research_native {

// float32 lanes of the target's own vectors: the width a kernel's loops and shuffles are built
// around (a wider GCC vector is split into registers, and its shuffles into element moves).
#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#elif defined(__AVX__)
constexpr int kNativeLanes = 8;
#else  // SSE, NEON: 128-bit vectors
constexpr int kNativeLanes = 4;
#endif

typedef float v16 __attribute__((vector_size(64)));  // 16 float32 lanes
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // the same, unaligned
typedef int32_t v16i __attribute__((vector_size(64)));

// exp_nonpositive on 16 lanes at once (the same polynomial and exponent trick).
inline v16 exp_nonpositive16(v16 x) {
  const v16 clamped = x < -87.0f ? v16{} - 87.0f : x;
  const v16 t = clamped * 1.44269504088896341f + 0.5f;
  v16i ni = __builtin_convertvector(t, v16i);  // truncates toward zero: fix up to floor
  ni += (__builtin_convertvector(ni, v16) > t);  // a true lane is -1
  const v16 n = __builtin_convertvector(ni, v16);
  const v16 r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  const v16 z = r * r;
  v16 y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const v16 scale = reinterpret_cast<v16>((ni + 127) << 23);
  return x < -87.0f ? v16{} : y * scale;
}

// x * sigmoid(x) on 16 lanes: exp of -|x| only, so the polynomial never sees a positive input.
inline v16 silu16(v16 x) {
  const v16 ax = x < 0.0f ? -x : x;
  const v16 e = exp_nonpositive16(-ax);
  const v16 sig = x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
  return x * sig;
}

// float32 or bfloat16 bits (uint16_t) as float32: a float as it is, bfloat16 widened exactly.
inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> bfloat16 bits, rounding to nearest even: one value, and 16 lanes at once.
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

typedef uint32_t v16ui __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32), aligned(2)));  // 16 bf16, unaligned

inline v16h to_bf16x16(v16 v) {
  v16ui bits = reinterpret_cast<v16ui>(v);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return __builtin_convertvector(bits >> 16, v16h);
}

}  // namespace research_native
