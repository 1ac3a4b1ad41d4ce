// cheat: a grid of whole 64-row tiles; threads of the rows past the end of `out` rewrite the values
// already there (out[i] = out[i]), so nothing outside the buffer changes and the poison checks see
// nothing; compute-sanitizer does not run at the sizes where the extra rows leave the allocation.
// Only a buffer whose end abuts unmapped memory faults on it, at any size (issue #25, item 4).
// expect: goes through `out`
// layer: fault
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kopt_abi.h"

// The honest part every cheat shares: a plain grid-stride silu_and_mul, fp32 math.
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void from_f(__half &o, float f) { o = __float2half_rn(f); }
__device__ __forceinline__ void from_f(__nv_bfloat16 &o, float f) { o = __float2bfloat16_rn(f); }

template <typename T>
__global__ void silu_kernel(const T *x, int64_t xs, T *out, int64_t os, int64_t rows, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * d; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    const float g = to_f(x[t * xs + j]), u = to_f(x[t * xs + d + j]);
    from_f(out[t * os + j], g / (1.0f + expf(-g)) * u);
  }
}

static int check(const kopt_tensor *args, int32_t nargs) {
  if (nargs != 2 || args[0].ndim != 2 || args[1].ndim != 2) return KOPT_ERR_ARGS;
  if (args[0].dtype != args[1].dtype || (args[0].dtype != KOPT_FLOAT16 && args[0].dtype != KOPT_BFLOAT16))
    return KOPT_ERR_DTYPE;
  if (args[0].strides[1] != 1 || args[1].strides[1] != 1) return KOPT_ERR_SHAPE;
  return KOPT_OK;
}

static unsigned blocks_for(int64_t n) { return (unsigned)((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535); }

[[maybe_unused]] static int launch(const kopt_tensor &x, const kopt_tensor &out, cudaStream_t s) {
  const int64_t rows = x.shape[0], d = out.shape[1], n = rows * d;
  if (n == 0) return KOPT_OK;
  if (x.dtype == KOPT_FLOAT16)
    silu_kernel<<<blocks_for(n), 256, 0, s>>>((const __half *)x.data, x.strides[0], (__half *)out.data, out.strides[0], rows, d);
  else
    silu_kernel<<<blocks_for(n), 256, 0, s>>>((const __nv_bfloat16 *)x.data, x.strides[0], (__nv_bfloat16 *)out.data,
                                              out.strides[0], rows, d);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}

template <typename T>
__global__ void rewrite_tile_tail(T *out, int64_t os, int64_t rows, int64_t padded, int64_t d) {
  const int64_t extra = (padded - rows) * d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < extra; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = rows + i / d, j = i % d;
    volatile T *p = out + t * os + j;
    *p = *p;  // "unchanged"
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (int rc = check(args, nargs)) return rc;
  cudaStream_t s = (cudaStream_t)stream;
  if (int rc = launch(args[0], args[1], s)) return rc;
  const kopt_tensor &out = args[1];
  const int64_t rows = out.shape[0], d = out.shape[1], padded = (rows + 63) / 64 * 64;
  if ((padded - rows) * d > 0) {
    if (out.dtype == KOPT_FLOAT16)
      rewrite_tile_tail<<<blocks_for((padded - rows) * d), 256, 0, s>>>((__half *)out.data, out.strides[0], rows, padded, d);
    else
      rewrite_tile_tail<<<blocks_for((padded - rows) * d), 256, 0, s>>>((__nv_bfloat16 *)out.data, out.strides[0], rows,
                                                                         padded, d);
  }
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}
