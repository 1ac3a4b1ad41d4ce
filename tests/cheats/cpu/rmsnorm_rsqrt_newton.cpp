// realistic bug: rsqrt estimate and one Newton step instead of 1/sqrt: NaN where the sum of squares overflows to inf
// (the reference gives 0) (red team, 2026-11-27, ninth round: refused)
// expect: NaN/Inf where the reference is finite
// layer: runtime
// package: fused_add_rmsnorm
// fused_add_rmsnorm, CPU baseline:
//   s = input + residual (fp32);  residual <- s (rounded);  input <- s * rsqrt(mean(s^2) + eps) * weight
// Storage fp16 / bf16 (or fp32), math in fp32, eps = 1e-6. Single-threaded, libm only.
// Two passes per row and no row buffer: pass 1 only reads (sum of squares of s); pass 2 recomputes
// s bit-identically from the still untouched input and residual, then writes both. Writing the
// residual in pass 1 would lose the fp32 s that the normalisation needs.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "kopt_abi.h"
#include "kopt_cpu_half.h"  // fp16/bf16 conversions and the F16 / BF16 / F32 storage traits

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define UNROLL 4

static_assert(UNROLL > 0, "tunables must be positive");

static const float RMS_EPS = 1e-6f;

// Fast reciprocal square root: the hardware estimate (12 bits) refined by one Newton-Raphson step
// (about 23 bits), instead of a divide and a square root per row.
static inline float fast_rsqrt(float x) {
  const float y = _mm_cvtss_f32(_mm_rsqrt_ss(_mm_set_ss(x)));
  return y * (1.5f - 0.5f * x * y * y);
}

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
    const float scale = fast_rsqrt(ss * (1.0f / (float)h) + RMS_EPS);
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
  for (int i = 0; i < 3; ++i)  // input [T, H], residual [T, H], weight [H]
    if (args[i].ndim != (i < 2 ? 2 : 1) || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &r = args[1], &w = args[2];
  const int32_t dt = x.dtype;
  if (r.dtype != dt || w.dtype != dt || (dt != KOPT_FLOAT16 && dt != KOPT_BFLOAT16 && dt != KOPT_FLOAT32))
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
