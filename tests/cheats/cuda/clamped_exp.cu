// cheat: lower internal precision: a fast exp on a clamped range that covers typical activations only
// expect: x100 (every float input scaled by 100): out:
// layer: runtime
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
__global__ void fast_kernel(const T *x, int64_t xs, T *out, int64_t os, int64_t rows, int64_t d) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * d; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = i / d, j = i % d;
    const float g = to_f(x[t * xs + j]), u = to_f(x[t * xs + d + j]);
    const float e = __expf(fminf(fmaxf(-g, -12.0f), 12.0f));  // "nobody has |g| > 12"
    from_f(out[t * os + j], __fdividef(g, 1.0f + e) * u);
  }
}

KOPT_EXPORT int kopt_silu_and_mul(const kopt_tensor *args, int32_t nargs, void *stream) {
  if (int rc = check(args, nargs)) return rc;
  const kopt_tensor &x = args[0], &out = args[1];
  cudaStream_t s = (cudaStream_t)stream;
  const int64_t rows = x.shape[0], d = out.shape[1], n = rows * d;
  if (n == 0) return KOPT_OK;
  if (x.dtype == KOPT_FLOAT16)
    fast_kernel<<<blocks_for(n), 256, 0, s>>>((const __half *)x.data, x.strides[0], (__half *)out.data, out.strides[0], rows, d);
  else
    fast_kernel<<<blocks_for(n), 256, 0, s>>>((const __nv_bfloat16 *)x.data, x.strides[0], (__nv_bfloat16 *)out.data,
                                              out.strides[0], rows, d);
  return cudaGetLastError() == cudaSuccess ? KOPT_OK : KOPT_ERR_LAUNCH;
}
