// fused_add_rmsnorm, CPU baseline:
//   s = input + residual (fp32);  residual <- s (rounded);  input <- s * rsqrt(mean(s^2) + eps) * weight
// Storage fp16 / bf16 (or fp32), math in fp32, eps = 1e-6. Single-threaded, libm only.
// Two passes per row and no row buffer: pass 1 only reads (sum of squares of s); pass 2 recomputes
// s bit-identically from the still untouched input and residual, then writes both. Writing the
// residual in pass 1 would lose the fp32 s that the normalisation needs.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define UNROLL 4

static_assert(UNROLL > 0, "tunables must be positive");

static const float RMS_EPS = 1e-6f;

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

template <class S>
static void fused_add_rmsnorm_rows(typename S::T *x, int64_t xs, typename S::T *r, int64_t rs,
                                   const typename S::T *w, int64_t rows, int64_t h) {
  using T = typename S::T;
  for (int64_t t = 0; t < rows; ++t) {
    T *xr = x + t * xs;
    T *rr = r + t * rs;
    // Pass 1: sum of s^2 in UNROLL independent partial sums (breaks the add dependency chain).
    float acc[UNROLL] = {};
    int64_t j = 0;
    for (; j + UNROLL <= h; j += UNROLL) {
#pragma GCC unroll 16
      for (int k = 0; k < UNROLL; ++k) {
        const float s = S::load(xr[j + k]) + S::load(rr[j + k]);
        acc[k] += s * s;
      }
    }
    for (; j < h; ++j) {
      const float s = S::load(xr[j]) + S::load(rr[j]);
      acc[0] += s * s;
    }
    float ss = 0.0f;
    for (int k = 0; k < UNROLL; ++k) ss += acc[k];
    const float scale = 1.0f / std::sqrt(ss / (float)h + RMS_EPS);
    // Pass 2: the same fp32 add gives the same s, so the residual is bit-exact.
    j = 0;
    for (; j + UNROLL <= h; j += UNROLL) {
#pragma GCC unroll 16
      for (int k = 0; k < UNROLL; ++k) {
        const float s = S::load(xr[j + k]) + S::load(rr[j + k]);
        rr[j + k] = S::store(s);
        xr[j + k] = S::store(s * scale * S::load(w[j + k]));
      }
    }
    for (; j < h; ++j) {
      const float s = S::load(xr[j]) + S::load(rr[j]);
      rr[j] = S::store(s);
      xr[j] = S::store(s * scale * S::load(w[j]));
    }
  }
}

KOPT_EXPORT int kopt_fused_add_rmsnorm(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;  // CPU target: always NULL
  if (args == nullptr || nargs != 3) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &r = args[1], &w = args[2];
  if (x.ndim != 2 || r.ndim != 2 || w.ndim != 1) return KOPT_ERR_ARGS;
  if (!x.shape || !x.strides || !r.shape || !r.strides || !w.shape || !w.strides) return KOPT_ERR_ARGS;
  if (x.dtype != r.dtype || x.dtype != w.dtype) return KOPT_ERR_DTYPE;
  if (x.dtype != KOPT_FLOAT16 && x.dtype != KOPT_BFLOAT16 && x.dtype != KOPT_FLOAT32)
    return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], h = x.shape[1];
  if (rows < 0 || h < 0 || r.shape[0] != rows || r.shape[1] != h || w.shape[0] != h) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || r.strides[1] != 1 || w.strides[0] != 1) return KOPT_ERR_SHAPE;  // dense rows
  if (rows == 0 || h == 0) return KOPT_OK;  // nothing to do
  if (!x.data || !r.data || !w.data) return KOPT_ERR_ARGS;

  const int64_t xs = x.strides[0], rs = r.strides[0];
  switch (x.dtype) {
    case KOPT_FLOAT16:
      fused_add_rmsnorm_rows<F16>((uint16_t *)x.data, xs, (uint16_t *)r.data, rs, (const uint16_t *)w.data, rows, h);
      break;
    case KOPT_BFLOAT16:
      fused_add_rmsnorm_rows<BF16>((uint16_t *)x.data, xs, (uint16_t *)r.data, rs, (const uint16_t *)w.data, rows, h);
      break;
    default:
      fused_add_rmsnorm_rows<F32>((float *)x.data, xs, (float *)r.data, rs, (const float *)w.data, rows, h);
      break;
  }
  return KOPT_OK;
}
