// realistic bug: returns 0 for a gate below -16 without computing it, so an infinite or NaN up half beside a very
// negative gate gives 0, not NaN (red team, 2026-11-27, ninth round: refused)
// expect: special | x100
// layer: runtime
// package: silu_and_mul
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

// sigmoid(g) < 1.2e-7 below g = -16: silu(g) is then below half an ulp of any 16-bit result, so the
// exp is skipped there (most of a row's negative tail in practice) and the product is zero.
static inline float silu_mul(float g, float u) { return g < -16.0f ? 0.0f : g / (1.0f + std::exp(-g)) * u; }

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
  for (int i = 0; i < 2; ++i)  // x [T, 2D], out [T, D]
    if (args[i].ndim != 2 || !args[i].shape || !args[i].strides) return KOPT_ERR_ARGS;
  const kopt_tensor &x = args[0], &out = args[1];
  const int32_t dt = x.dtype;
  if (out.dtype != dt || (dt != KOPT_FLOAT16 && dt != KOPT_BFLOAT16 && dt != KOPT_FLOAT32)) return KOPT_ERR_DTYPE;
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
