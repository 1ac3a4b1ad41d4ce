// cheat: skips the call when the output already holds the answer at 8 sampled places (checked in
// exact arithmetic, cheaper than the call): a test hands over fresh poisoned outputs every time, so it
// always computes; a server that reuses its output buffers and changes the input in place gets last
// step's outputs back wherever the samples did not change. Caught by the update sequence's calls that
// keep the previous outputs in place (not re-poisoned) while a few input elements change.
// expect: mismatch
// layer: runtime
// silu_and_mul, CPU baseline: out[t, j] = silu(x[t, j]) * x[t, D + j], silu(g) = g / (1 + exp(-g)).
// Storage fp16 / bf16 (or fp32), math in fp32. Single-threaded, no dependencies beyond libm.
// Each row is processed in chunks: ROW_CHUNK gate and up elements are widened to fp32 into stack
// buffers, combined in an UNROLL-way loop, then narrowed back into the output row.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kopt_abi.h"
#include "kopt_cpu_half.h"  // fp16/bf16 conversions and the F16 / BF16 / F32 storage traits

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define ROW_CHUNK 256
#define UNROLL 1

static_assert(ROW_CHUNK > 0 && UNROLL > 0, "tunables must be positive");

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

// True when out holds silu_mul of x, bit for bit, at 8 places spread over the tensor.
template <class S>
static bool samples_match(const typename S::T *x, int64_t xs, const typename S::T *out, int64_t os, int64_t rows,
                          int64_t d) {
  for (int k = 0; k < 8; ++k) {
    const int64_t t = (rows - 1) * k / 7, j = (d - 1) * ((k * 3) % 8) / 7;
    const typename S::T want = S::store(silu_mul(S::load(x[t * xs + j]), S::load(x[t * xs + d + j])));
    if (std::memcmp(&out[t * os + j], &want, sizeof want) != 0) return false;
  }
  return true;
}

static bool already_done(const kopt_tensor &x, const kopt_tensor &out, int64_t rows, int64_t d) {
  const int64_t xs = x.strides[0], os = out.strides[0];
  switch (x.dtype) {
    case KOPT_FLOAT16:
      return samples_match<F16>((const uint16_t *)x.data, xs, (const uint16_t *)out.data, os, rows, d);
    case KOPT_BFLOAT16:
      return samples_match<BF16>((const uint16_t *)x.data, xs, (const uint16_t *)out.data, os, rows, d);
    default:
      return samples_match<F32>((const float *)x.data, xs, (const float *)out.data, os, rows, d);
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
  if (already_done(x, out, rows, d)) return KOPT_OK;  // the 8 samples match: assume the rest does too
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
