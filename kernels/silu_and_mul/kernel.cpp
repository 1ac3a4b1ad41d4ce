// silu_and_mul, CPU baseline: out[t, j] = silu(x[t, j]) * x[t, D + j], silu(g) = g / (1 + exp(-g)).
// Storage fp16 / bf16 (or fp32), math in fp32. Single-threaded, no dependencies beyond libm.
// Each row is processed in chunks: ROW_CHUNK gate and up elements are widened to fp32 into stack
// buffers, combined in an UNROLL-way loop, then narrowed back into the output row.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define ROW_CHUNK 256
#define UNROLL 1

static_assert(ROW_CHUNK > 0 && UNROLL > 0, "tunables must be positive");

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

static inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

template <class S>
static void silu_and_mul_rows(const typename S::T *x, int64_t x_row_stride, typename S::T *out,
                              int64_t out_row_stride, int64_t rows, int64_t d) {
  using T = typename S::T;
  float gate[ROW_CHUNK], up[ROW_CHUNK];  // fp32 staging; 2 * 4 * ROW_CHUNK bytes of stack
  for (int64_t t = 0; t < rows; ++t) {
    const T *xg = x + t * x_row_stride;  // gate half of the row
    const T *xu = xg + d;                // up half of the row
    T *o = out + t * out_row_stride;
    for (int64_t j0 = 0; j0 < d; j0 += ROW_CHUNK) {
      const int n = (int)(d - j0 < ROW_CHUNK ? d - j0 : ROW_CHUNK);
      for (int i = 0; i < n; ++i) {
        gate[i] = S::load(xg[j0 + i]);
        up[i] = S::load(xu[j0 + i]);
      }
      int i = 0;
      for (; i + UNROLL <= n; i += UNROLL) {  // main loop, UNROLL independent elements per step
#pragma GCC unroll 16
        for (int k = 0; k < UNROLL; ++k) gate[i + k] = silu_mul(gate[i + k], up[i + k]);
      }
      for (; i < n; ++i) gate[i] = silu_mul(gate[i], up[i]);  // remainder (n % UNROLL)
      for (int k = 0; k < n; ++k) o[j0 + k] = S::store(gate[k]);
    }
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  (void)stream;  // CPU target: always NULL
  if (args == nullptr || nargs != 2) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &out = args[1];
  if (x.ndim != 2 || out.ndim != 2 || !x.shape || !x.strides || !out.shape || !out.strides)
    return KOPT_ERR_ARGS;
  if (x.dtype != out.dtype) return KOPT_ERR_DTYPE;
  if (x.dtype != KOPT_FLOAT16 && x.dtype != KOPT_BFLOAT16 && x.dtype != KOPT_FLOAT32)
    return KOPT_ERR_DTYPE;
  const int64_t rows = x.shape[0], d = out.shape[1];
  if (rows < 0 || d < 0 || out.shape[0] != rows || x.shape[1] != 2 * d) return KOPT_ERR_SHAPE;
  if (x.strides[1] != 1 || out.strides[1] != 1) return KOPT_ERR_SHAPE;  // rows must be dense
  if (rows == 0 || d == 0) return KOPT_OK;                                // nothing to do
  if (!x.data || !out.data) return KOPT_ERR_ARGS;

  const int64_t xs = x.strides[0], os = out.strides[0];
  switch (x.dtype) {
    case KOPT_FLOAT16:
      silu_and_mul_rows<F16>((const uint16_t *)x.data, xs, (uint16_t *)out.data, os, rows, d);
      break;
    case KOPT_BFLOAT16:
      silu_and_mul_rows<BF16>((const uint16_t *)x.data, xs, (uint16_t *)out.data, os, rows, d);
      break;
    default:
      silu_and_mul_rows<F32>((const float *)x.data, xs, (float *)out.data, os, rows, d);
      break;
  }
  return KOPT_OK;
}
