// OPEN (red team, 2026-11-27, ninth round; accepted twice): a dense fast path that addresses rows with `int`
// flat offsets (t * 2 * d), which wrap once T * 2D passes 2^31 elements (T=40000, D=28672 fp16: a crash). Not
// refused: CPU gates never run a call of 2^31 elements (4 GiB of fp16 input, seconds a call); CUDA's do
// (decision 0051)
// expect: none yet
// layer: runtime
// package: silu_and_mul
// Bug: when x and out have no row padding, rows are addressed with `int` flat offsets
// (xbase = t * 2 * d). Once T * 2D exceeds 2^31 elements the offset wraps negative, and the
// kernel reads/writes outside the buffers (crash or garbage). The strided path (int64) is fine.
// Breaking input: x fp16 [T=40000, 2*D=57344] (D = 28672, Llama-3-70B's MLP width; any row with
// t >= 37450), dense, values uniform in [-4, 4]. The red team's g++ harness: on T=64, D=4096 it
// finds 0 mismatches; on T=40000, D=28672 it prints "candidate crashed with SIGSEGV
// (read/write outside the buffers)", where the reference gives finite silu(g)*u everywhere.
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

// Dense fast path (x is [T, 2D] and out is [T, D] with no row padding, the common case): rows are
// addressed from the flat element index, gate at t*2D, up at t*2D + D, out at t*D.
template <class S>
static void silu_and_mul_dense(const typename S::T *x, typename S::T *out, int rows, int d) {
  using T = typename S::T;
  float gate[ROW_CHUNK], up[ROW_CHUNK];
  for (int t = 0; t < rows; ++t) {
    const int xbase = t * 2 * d, obase = t * d;
    for (int j0 = 0; j0 < d; j0 += ROW_CHUNK) {
      const int n = d - j0 < ROW_CHUNK ? d - j0 : ROW_CHUNK;
      for (int i = 0; i < n; ++i) {
        gate[i] = S::load(x[xbase + j0 + i]);
        up[i] = S::load(x[xbase + d + j0 + i]);
      }
      for (int i = 0; i < n; ++i) gate[i] = silu_mul(gate[i], up[i]);
      for (int k = 0; k < n; ++k) out[obase + j0 + k] = S::store(gate[k]);
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
  if (xs == 2 * d && os == d) {
    switch (x.dtype) {
      case KOPT_FLOAT16: silu_and_mul_dense<F16>((const uint16_t *)x.data, (uint16_t *)out.data, (int)rows, (int)d); break;
      case KOPT_BFLOAT16: silu_and_mul_dense<BF16>((const uint16_t *)x.data, (uint16_t *)out.data, (int)rows, (int)d); break;
      default: silu_and_mul_dense<F32>((const float *)x.data, (float *)out.data, (int)rows, (int)d); break;
    }
    return KOPT_OK;
  }
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
