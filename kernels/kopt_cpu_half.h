/* kopt CPU helpers: fp16 / bf16 <-> fp32 conversions and storage traits for CPU kernels.
 *
 * Bit manipulation, so -ffast-math cannot change the rounding (round to nearest, ties to even;
 * inf, nan and fp16 subnormals handled). Include after <cstdint> and <cstring>.
 */
#ifndef KOPT_CPU_HALF_H
#define KOPT_CPU_HALF_H

#include <cstdint>
#include <cstring>

// ---- 16-bit float conversions, by bit manipulation so that -ffast-math cannot change them ----

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / nan (payload kept)
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);  // +-0
    // Subnormal man * 2^-24: normalize so the leading 1 reaches bit 10 (the implicit bit).
    uint32_t e = 113;  // float biased exponent of 2^-14, minus one per shift below
    while (!(man & 0x400u)) { man <<= 1; --e; }
    return bits_f32(sign | (e << 23) | ((man & 0x3ffu) << 13));
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));  // rebias 15 -> 127
}

static inline uint16_t f32_to_f16(float f) {  // round to nearest, ties to even
  uint32_t x = f32_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;               // nan -> quiet nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;              // >= 65520 (or inf) rounds to inf
  if (ax >= 0x38800000u) {                                   // normal half: |f| >= 2^-14
    uint32_t r = ax - 0x38000000u;                           // rebias 127 -> 15
    r += 0xfffu + ((r >> 13) & 1u);                          // RNE on the 13 dropped bits
    return sign | (uint16_t)(r >> 13);                       // a mantissa carry bumps the exponent
  }
  if (ax <= 0x33000000u) return sign;                        // <= 2^-25 (a tie) rounds to +-0
  // Subnormal half: q = |f| / 2^-24, rounded. |f| = m * 2^(e - 150) with a 24-bit m.
  uint32_t e = ax >> 23;                                     // 102..112 here
  uint32_t m = (ax & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126 - e;                                  // 14..24
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;          // may reach 0x400 = 2^-14: still right
  return sign | (uint16_t)q;
}

static inline float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

static inline uint16_t f32_to_bf16(float f) {  // round to nearest, ties to even
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);  // overflow past the max finite value lands on inf, as it should
  return (uint16_t)(x >> 16);
}

// ---- storage traits: element type and its fp32 widening / narrowing ----

struct F16  { using T = uint16_t; static float load(T v) { return f16_to_f32(v); }  static T store(float f) { return f32_to_f16(f); } };
struct BF16 { using T = uint16_t; static float load(T v) { return bf16_to_f32(v); } static T store(float f) { return f32_to_bf16(f); } };
struct F32  { using T = float;    static float load(T v) { return v; }              static T store(float f) { return f; } };

#endif /* KOPT_CPU_HALF_H */
