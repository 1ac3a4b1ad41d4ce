// silu_and_mul, CUDA baseline (in the style of SGLang / FlashInfer act_and_mul):
//   out[t, j] = silu(x[t, j]) * x[t, D + j],  silu(g) = g / (1 + exp(-g)),
// fp16 / bf16 (or fp32) storage, fp32 math. BLOCKS_PER_ROW blocks share one row; their threads
// interleave over it, VEC elements per thread per step (16-byte accesses at VEC = 8, 16-bit).
// The vectorized path needs D % VEC == 0 and every row base (gate, up, out) aligned for a
// VEC-element access; otherwise the scalar path runs. Both are chosen per launch on the host.
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// Tunables (one `#define NAME VALUE` line each; any listed value must stay correct).
#define VEC 8
#define THREADS 256
#define BLOCKS_PER_ROW 1

static_assert(VEC > 0 && THREADS > 0 && THREADS <= 1024 && BLOCKS_PER_ROW > 0, "bad tunables");

// fp32 <-> storage conversions (round to nearest even on the way back).
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ __half from_f32<__half>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }

// expf, not __expf: the baseline keeps full-precision exp (--use_fast_math is the tuner's call).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// VEC elements moved as one aligned access (ld/st.global.v{2,4} where the size allows).
template <typename T>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, bool VECTORIZED>
__global__ void __launch_bounds__(THREADS)
silu_and_mul_kernel(const T *__restrict__ x, int64_t x_row_stride, T *__restrict__ out,
                    int64_t out_row_stride, int64_t rows, int d) {
  const int part = blockIdx.x % BLOCKS_PER_ROW;     // which slice of the row's threads we are
  const int first = part * THREADS + threadIdx.x;   // thread index within the row
  const int step = BLOCKS_PER_ROW * THREADS;        // threads per row
  const int64_t row_step = gridDim.x / BLOCKS_PER_ROW;
  // Grid-stride over rows so that any T works even if the grid was capped on the host.
  for (int64_t t = blockIdx.x / BLOCKS_PER_ROW; t < rows; t += row_step) {
    const T *gate = x + t * x_row_stride;
    const T *up = gate + d;
    T *o = out + t * out_row_stride;
    if constexpr (VECTORIZED) {
      using P = Pack<T>;
      const P *gp = reinterpret_cast<const P *>(gate);
      const P *up_p = reinterpret_cast<const P *>(up);
      P *op = reinterpret_cast<P *>(o);
      const int n = d / VEC;  // exact: the host checked d % VEC == 0
      for (int i = first; i < n; i += step) {
        const P g = gp[i], u = up_p[i];
        P r;
#pragma unroll
        for (int k = 0; k < VEC; ++k) r.v[k] = from_f32<T>(silu_mul(to_f32(g.v[k]), to_f32(u.v[k])));
        op[i] = r;
      }
    } else {
      for (int j = first; j < d; j += step) o[j] = from_f32<T>(silu_mul(to_f32(gate[j]), to_f32(up[j])));
    }
  }
}

template <typename T>
static int launch(const kopt_tensor &x, const kopt_tensor &out, int64_t rows, int d, cudaStream_t stream) {
  const int64_t xs = x.strides[0], os = out.strides[0];
  // Every row base is VEC-aligned iff the first one is and the row strides (and d, for the up
  // half) are multiples of VEC elements.
  const uintptr_t align = sizeof(T) * VEC;
  const bool vectorized = d % VEC == 0 && xs % VEC == 0 && os % VEC == 0 &&
                          reinterpret_cast<uintptr_t>(x.data) % align == 0 &&
                          reinterpret_cast<uintptr_t>(out.data) % align == 0;
  // One block group per row, capped to the 1D grid limit (the kernel strides over extra rows).
  const int64_t max_rows = INT_MAX / BLOCKS_PER_ROW;
  const unsigned grid = (unsigned)((rows < max_rows ? rows : max_rows) * BLOCKS_PER_ROW);
  const T *xp = static_cast<const T *>(x.data);
  T *op = static_cast<T *>(out.data);
  if (vectorized)
    silu_and_mul_kernel<T, true><<<grid, THREADS, 0, stream>>>(xp, xs, op, os, rows, d);
  else
    silu_and_mul_kernel<T, false><<<grid, THREADS, 0, stream>>>(xp, xs, op, os, rows, d);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
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
  // In-row indices are int; keep 2*d plus one thread stride clear of overflow.
  if (d > INT_MAX / 4) return KOPT_ERR_SHAPE;
  if (rows == 0 || d == 0) return KOPT_OK;  // nothing to launch
  if (!x.data || !out.data) return KOPT_ERR_ARGS;

  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (x.dtype) {
    case KOPT_FLOAT16: return launch<__half>(x, out, rows, (int)d, s);
    case KOPT_BFLOAT16: return launch<__nv_bfloat16>(x, out, rows, (int)d, s);
    default: return launch<float>(x, out, rows, (int)d, s);
  }
}
